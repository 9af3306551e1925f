"""The policy YAML schema. Validation errors name the offending field."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.base import RoutingPolicy
from policies.registry import make_policy


class PolicyConfigError(ValueError):
    """A policy file that cannot be used; the message names the field and the problem."""


class PolicyConfig(BaseModel):
    """Top level of the policy file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = "round_robin"
    seed: int = 0
    options: dict[str, Any] = Field(default_factory=dict)


def parse_policy_yaml(text: str) -> PolicyConfig:
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise PolicyConfigError(f"policy file is not valid YAML: {exc}") from None
    try:
        return PolicyConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise PolicyConfigError(f"invalid policy file: {problems}") from None


def build_policy(config: PolicyConfig) -> RoutingPolicy:
    """Instantiate the configured policy; an unknown policy name is a `PolicyConfigError`."""
    try:
        return make_policy(config.policy, seed=config.seed, **config.options)
    except (ValueError, TypeError) as exc:
        raise PolicyConfigError(f"policy: {exc}") from None
