"""The policy YAML schema (docs/policy.md has an annotated example).

Validation errors name the offending field (`pools.chat.cost_model.step_s: ...`). Parsing and
building are separate so a hot reload can build the new policy completely before swapping it in;
any failure is a `PolicyConfigError` and the caller keeps the running policy.

Operator files are read with `policies.operator_yaml.load_operator_yaml`, which bounds what
aliases expand to and refuses a key said twice in one mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policies.base import Isolation, RoutingPolicy
from policies.cost_params import PROFILES, CostModelParams, profile
from policies.herd import HOLD_STEPS_S
from policies.index import IndexConfig
from policies.operator_yaml import OperatorYamlError, load_operator_yaml
from policies.pools import PoolSettings
from policies.prefix_policy import SharedSettings
from policies.registry import known_policies, make_policy
from policies.tenants import PromotionConfig, TenantSettings
from prompt_normalizer.normalizer import NormalizerConfig
from prompt_normalizer.types import PUBLIC_NAMESPACE, BlockKey


class PolicyConfigError(ValueError):
    """A policy file that cannot be used; the message names the field and the problem."""


class _Strict(BaseModel):
    # `.inf` and `.nan` are YAML floats: no setting means either (an infinite weight or time
    # would turn scores and deadlines into NaN or overflow far from the line that set it).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class IndexYaml(_Strict):
    """Index sizing for one pool (tokens, holdings, namespace share, speculative TTL, granularity)."""

    default_capacity_tokens: int = Field(430_000, ge=0)
    max_entries: int = Field(4_000_000, ge=1)
    namespace_share: float = Field(0.5, gt=0.0, le=1.0)
    speculative_ttl_s: float = Field(60.0, gt=0.0)
    granularity_blocks: int = Field(1, ge=1)
    max_workers: int = Field(1024, ge=1)
    recency_resolution_s: float = Field(1.0, ge=0.0)

    def build(self) -> IndexConfig:
        return IndexConfig(**self.model_dump())


class CostModelYaml(_Strict):
    """A named profile plus optional overrides of its constants (seconds, tokens, bytes)."""

    profile: str = "llama3-8b-h100"
    step_s: float | None = Field(None, ge=0)
    prefill_s_per_token: float | None = Field(None, ge=0)
    attention_s_per_pair: float | None = Field(None, ge=0)
    decode_s_per_request: float | None = Field(None, ge=0)
    decode_s_per_context_token: float | None = Field(None, ge=0)
    max_batched_tokens: int | None = Field(None, ge=1)
    ingestion_s: float | None = Field(None, ge=0)
    calibrate: bool | None = None
    calibration_weight: float | None = Field(None, ge=0, le=1)
    transfer_enabled: bool | None = None
    transfer_bytes_per_token: int | None = Field(None, ge=1)
    transfer_bandwidth_bytes_per_s: float | None = Field(None, gt=0)
    transfer_setup_s: float | None = Field(None, ge=0)
    cold_adapter_s: float | None = Field(None, ge=0)
    warming_s: float | None = Field(None, ge=0)
    prefill_progress: float | None = Field(None, ge=0, le=1)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        if value not in PROFILES:
            raise ValueError(f"unknown profile {value!r}; known: {', '.join(sorted(PROFILES))}")
        return value

    def build(self) -> CostModelParams:
        overrides = {k: v for k, v in self.model_dump(exclude={"profile"}).items() if v is not None}
        return profile(self.profile, **overrides)


class PoolYaml(_Strict):
    """One pool: its index, its cost model, and static capacities for workers that report none."""

    index: IndexYaml = IndexYaml()
    cost_model: CostModelYaml = CostModelYaml()
    capacity_fraction: float = Field(0.9, gt=0.0, le=1.0)
    worker_capacity_tokens: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)

    def build(self) -> PoolSettings:
        return PoolSettings(
            index=self.index.build(),
            cost=self.cost_model.build(),
            capacity_fraction=self.capacity_fraction,
            worker_capacity_tokens=dict(self.worker_capacity_tokens),
        )


class TenantYaml(_Strict):
    """A tenant's sharing settings (the gateway maps API keys to tenant names)."""

    isolation: Isolation = Isolation.STRICT
    index_share: float | None = Field(None, gt=0.0, le=1.0)


class PublicPrefixesYaml(_Strict):
    """Promotion of immutable chains to the public namespace; allow_list holds chain keys in hex."""

    min_tenants: int = Field(3, ge=1)
    window_s: float = Field(600.0, gt=0)
    cool_after_s: float = Field(1800.0, gt=0)
    allow_list: list[str] = Field(default_factory=list)
    max_candidates: int = Field(10_000, ge=1)

    @field_validator("allow_list")
    @classmethod
    def _hex_keys(cls, values: list[str]) -> list[str]:
        for v in values:
            try:
                key = int(v, 16)
            except ValueError:
                raise ValueError(f"{v!r} is not a hex chain key") from None
            if not 0 <= key < 1 << 64:
                raise ValueError(f"{v!r} is not a 64-bit chain key")
        return values

    def build(self) -> PromotionConfig:
        return PromotionConfig(
            min_tenants=self.min_tenants,
            window_s=self.window_s,
            cool_after_s=self.cool_after_s,
            allow_list=frozenset(BlockKey(int(v, 16)) for v in self.allow_list),
            max_candidates=self.max_candidates,
        )


class CostParamsYaml(_Strict):
    epsilon: float = Field(0.5, ge=0)
    slack_requests: float = Field(8.0, ge=0)
    work_weight: float = Field(2.0, ge=0)
    max_queue_factor: float = Field(8.0, ge=0)
    tie_s: float = Field(1e-4, ge=0)
    branch_load_weight: float = Field(1.0, ge=0)
    load_window_s: float = Field(180.0, gt=0)
    discount_cached_backlog: bool | Literal["holders"] | None = None
    continuation_slack_requests: float = Field(0.0, ge=0)
    keep_tpot_s: float = Field(0.0, ge=0)
    max_recompute_s: float | None = Field(None, gt=0)
    herd_weight: float = Field(2.0, ge=0)
    herd_hold_steps: int = Field(len(HOLD_STEPS_S), ge=0, le=len(HOLD_STEPS_S))
    ttft_objective_s: float | None = Field(None, gt=0)
    decode_price_s: float = Field(0.0, ge=0)
    tpot_objective_s: float = Field(0.1, gt=0)
    stay_objective_s: float | None = Field(1.4, gt=0)
    stay_within_s: float = Field(0.7, ge=0)
    stay_waited_within_s: float | None = Field(3.0, ge=0)
    stay_tpot_s: float = Field(0.05, ge=0)


class SglangParamsYaml(_Strict):
    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_size_tokens: int = Field((1 << 26) // 4, ge=1)


class ConsistentHashParamsYaml(_Strict):
    load_factor: float = Field(1.25, ge=1)
    vnodes: int = Field(100, ge=1)
    prefix_blocks: int = Field(4, ge=1)


class PrebleParamsYaml(_Strict):
    window_s: float = Field(180.0, gt=0)
    output_history: int = Field(200, ge=1)


class PolicyConfig(_Strict):
    """Top level of the policy file."""

    policy: str = "cost"
    seed: int = 0
    cost: CostParamsYaml = CostParamsYaml()
    sglang_cache_aware: SglangParamsYaml = SglangParamsYaml()
    consistent_hash: ConsistentHashParamsYaml = ConsistentHashParamsYaml()
    preble_e2: PrebleParamsYaml = PrebleParamsYaml()
    default_pool: PoolYaml = PoolYaml()
    pools: dict[str, PoolYaml] = Field(default_factory=dict)
    tenants: dict[str, TenantYaml] = Field(default_factory=dict)
    default_tenant_index_share: float | None = Field(None, gt=0.0, le=1.0)
    public_prefixes: PublicPrefixesYaml = PublicPrefixesYaml()
    precise_namespace: str = PUBLIC_NAMESPACE
    # Read by the gateway: the normalizer of pools whose gateway config names none.
    normalizer: NormalizerConfig = NormalizerConfig()

    def unused_sections(self) -> list[str]:
        """The sections of other policies than `policy` that the file sets: the running policy
        reads none of them (kept, say, while trying another policy; or a typo in `policy`)."""
        return [
            name
            for name in ("cost", "sglang_cache_aware", "consistent_hash", "preble_e2")
            if name != self.policy and name in self.model_fields_set
        ]

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        known = known_policies()
        if value not in known:
            raise ValueError(f"unknown policy {value!r}; known: {', '.join(known)}")
        return value

    def shared_settings(self) -> SharedSettings:
        return SharedSettings(
            pools={name: pool.build() for name, pool in self.pools.items()},
            default_pool=self.default_pool.build(),
            tenants={
                name: TenantSettings(isolation=t.isolation, index_share=t.index_share)
                for name, t in self.tenants.items()
            },
            default_index_share=self.default_tenant_index_share,
            promotion=self.public_prefixes.build(),
            precise_namespace=self.precise_namespace,
        )


def _format(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
    )


def parse_policy_yaml(text: str, base: Path | None = None) -> PolicyConfig:
    """Parse and validate a policy file; any problem is a `PolicyConfigError` naming the field.

    `base` is the folder of the file: a relative path in it (the normalizer's tokenizer folder and
    chat template) is resolved against it, wherever the reader was started from."""
    try:
        raw = load_operator_yaml(text)
    except OperatorYamlError as exc:
        raise PolicyConfigError(f"policy file: {exc}") from None
    except yaml.YAMLError as exc:
        raise PolicyConfigError(f"policy file is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise PolicyConfigError("invalid policy file: <root>: expected a mapping of settings")
    try:
        config = PolicyConfig.model_validate(raw)
    except ValidationError as exc:
        raise PolicyConfigError(f"invalid policy file: {_format(exc)}") from None
    return config if base is None else _paths_relative_to(config, base)


def _paths_relative_to(config: PolicyConfig, base: Path) -> PolicyConfig:
    normalizer = config.normalizer
    update = {
        field: str(base / value)
        for field in ("tokenizer_dir", "chat_template_file")
        if isinstance(value := getattr(normalizer, field), str) and not Path(value).is_absolute()
    }
    if not update:
        return config
    return config.model_copy(update={"normalizer": normalizer.model_copy(update=update)})


def policy_kwargs(config: PolicyConfig) -> dict[str, Any]:
    """The keyword arguments `make_policy` gets for the configured policy."""
    name = config.policy
    kwargs: dict[str, Any] = {}
    if name == "cost":
        kwargs.update(config.cost.model_dump(), shared=config.shared_settings())
    elif name == "sglang_cache_aware":
        kwargs.update(config.sglang_cache_aware.model_dump(), shared=config.shared_settings())
    elif name == "preble_e2":
        kwargs.update(config.preble_e2.model_dump(), shared=config.shared_settings())
    elif name == "consistent_hash":
        kwargs.update(config.consistent_hash.model_dump())
    return kwargs


def build_policy(config: PolicyConfig) -> RoutingPolicy:
    """Instantiate the configured policy completely; any failure is a `PolicyConfigError`."""
    try:
        return make_policy(config.policy, seed=config.seed, **policy_kwargs(config))
    except (ValueError, TypeError) as exc:
        raise PolicyConfigError(f"{config.policy}: {exc}") from None
