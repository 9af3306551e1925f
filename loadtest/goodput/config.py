"""The goodput benchmark's YAML: SLOs and rate bounds per trace, policies, attainment share, tolerance.

A shipped default (`default.yaml` beside this module) holds the settings the published figures were
measured with, so `kvgate bench goodput` with no arguments reruns them. Validation errors name the
field (`traces.kvct-agent.ttft_slo_s: ...`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_CONFIG = "default.yaml"


class GoodputConfigError(ValueError):
    """A goodput file that cannot be used; the message names the field and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TraceSpec(_Strict):
    """One trace: how it is replayed, its SLOs, and where the rate search starts and stops.

    `reference_rate_scale` is where the coarse search starts; it is chosen so that round_robin runs
    at 70–85 % utilization, and every policy is measured there, so its raw TTFT p99 can be compared
    at that load as well. Rates are multipliers of the trace's own arrival rate.
    """

    ttft_slo_s: float = Field(gt=0)
    tpot_slo_s: float = Field(gt=0)
    reference_rate_scale: float = Field(1.0, gt=0)
    min_rate_scale: float = Field(0.05, gt=0)
    max_rate_scale: float = Field(64.0, gt=0)
    users: int = Field(1, ge=1)
    user_spread_s: float = Field(0.0, ge=0)
    kv_blocks_per_worker: int | None = Field(None, gt=0)
    max_requests: int | None = Field(None, gt=0)
    window_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> TraceSpec:
        if not self.min_rate_scale <= self.reference_rate_scale <= self.max_rate_scale:
            raise ValueError("need min_rate_scale <= reference_rate_scale <= max_rate_scale")
        return self


class GoodputConfig(_Strict):
    """The whole benchmark. `baselines` are the policies every row's capacity is divided by;
    `subject` is the policy the report reads against the best other one. With `stop_early`, a
    point above the reference rate stops as soon as it can no longer meet the share."""

    policies: tuple[str, ...] = Field(min_length=1)
    baselines: tuple[str, ...] = ()
    subject: str = "cost"
    attainment_share: float = Field(0.9, gt=0, le=1)
    tolerance: float = Field(0.05, gt=0, le=1)
    coarse_factor: float = Field(2.0, gt=1)
    workers: int = Field(8, ge=1)
    profile: str = "llama3-8b-h100"
    seed: int = 0
    scrape_interval_s: float = Field(1.0, gt=0)
    stop_early: bool = True
    traces: dict[str, TraceSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _names(self) -> GoodputConfig:
        unknown = [b for b in self.baselines if b not in self.policies]
        if unknown:
            raise ValueError(f"baselines {unknown} are not among the policies")
        return self


def parse_goodput_yaml(text: str) -> GoodputConfig:
    """Parse a goodput YAML document; `GoodputConfigError` names the offending field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise GoodputConfigError(f"not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise GoodputConfigError("the goodput file must be a YAML mapping")
    try:
        return GoodputConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise GoodputConfigError(f"{where}: {first['msg']}") from exc


def default_config_text() -> str:
    return resources.files("loadtest.goodput").joinpath(DEFAULT_CONFIG).read_text(encoding="utf-8")


def load_goodput_config(path: str | None) -> GoodputConfig:
    """The file at `path`, or the shipped default when None."""
    if path is None:
        return parse_goodput_yaml(default_config_text())
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise GoodputConfigError(f"{path}: {exc}") from exc
    return parse_goodput_yaml(text)
