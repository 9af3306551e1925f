"""The goodput benchmark's YAML: SLOs and rate bounds per trace, policies, attainment share, tolerance.

A shipped default (`default.yaml` beside this module) holds the settings the published figures were
measured with, so `kvgate bench goodput` with no arguments reruns them. Validation errors name the
field (`traces.kvct-agent.ttft_slo_s: ...`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from policies.config import PolicyConfig
from policies.pd import HOLDER_PREFILL

DEFAULT_CONFIG = "default.yaml"


class GoodputConfigError(ValueError):
    """A goodput file that cannot be used; the message names the field and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TraceSpec(_Strict):
    """One trace: how it is replayed, its SLOs, and where the rate search starts and stops.

    `reference_rate_scale` is where the coarse search starts; it is chosen so that round_robin runs
    at 70–85 % utilization, and every policy is measured there, so its raw TTFT p99 can be compared
    at that load as well. Rates are multipliers of the trace's own arrival rate. `closed_loop`
    replays an agent trace as its client would (`kvgate simulate --closed-loop`): a turn waits for
    the answers it follows, then its think time divided by the rate. `trace` is the shipped trace
    or file the entry replays (default: the entry's name), so that two entries may replay one
    trace two ways.

    `load: users` searches, closed loop only, over the number of users instead of the rate: every
    point replays the trace at `reference_rate_scale` (its think times divided by it) as `users`
    users at first, then as many as the search asks for, within [`min_users`, `max_users`]. Closed
    loop, a user has at most one turn in flight, so the users are the load, as kv-cache-tester
    measures an agent deployment's capacity.
    """

    trace: str | None = None

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
    closed_loop: bool = False
    load: Literal["rate", "users"] = "rate"
    min_users: int = Field(1, ge=1)
    max_users: int = Field(1024, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> TraceSpec:
        if not self.min_rate_scale <= self.reference_rate_scale <= self.max_rate_scale:
            raise ValueError("need min_rate_scale <= reference_rate_scale <= max_rate_scale")
        if self.load == "users":
            if not self.closed_loop:
                raise ValueError("load: users needs closed_loop: true (open loop the rate is the load)")
            if not self.min_users <= self.users <= self.max_users:
                raise ValueError("need min_users <= users <= max_users")
            if self.max_requests is not None or self.window_s is not None:
                # A slice keeps the users starting inside it, or the same requests at every count.
                raise ValueError("load: users replays whole users: no max_requests or window_s")
        return self

    @property
    def by_users(self) -> bool:
        return self.load == "users"

    @property
    def reference_load(self) -> float:
        """Where the search starts and every row is replayed in full: the reference rate, or the
        starting users."""
        return float(self.users) if self.by_users else self.reference_rate_scale

    @property
    def load_bounds(self) -> tuple[float, float]:
        if self.by_users:
            return float(self.min_users), float(self.max_users)
        return self.min_rate_scale, self.max_rate_scale

    def load_text(self, load: float) -> str:
        """A load as the report writes it: "11×" or "40 users"."""
        return f"{load:g} users" if self.by_users else f"{load:g}×"


class PolicyEntry(_Strict):
    """One row of the benchmark that is more than a policy name: `policy` routing a P/D pool of
    `pd` = "P:D" prefill and decode workers (the simulator's `--pd`, pairs chosen as the gateway
    chooses them, `policy` picking the prefill worker), or with `settings`: a policy file's
    settings for it ([policy.md](../../docs/policy.md), without `policy` and `seed`), e.g.
    `{default_pool: {capacity_fraction: 1.0}}`. `pd: holder_prefill` keeps the workers mixed
    with the chooser in that mode (`kvgate simulate --pd holder_prefill`). `name` is the row's
    label (default: "POLICY P:D", or POLICY); `pd_conditional` lets a request run alone on a
    decode worker when that scores better, as the gateway's default does. `objective: true`
    gives `cost` each trace's TTFT objective as its `ttft_objective_s` (docs/policy.md)."""

    name: str | None = None
    policy: str
    pd: str | None = None
    pd_conditional: bool = True
    settings: dict[str, Any] | None = None
    objective: bool = False

    @model_validator(mode="after")
    def _split(self) -> PolicyEntry:
        self.split()
        if self.objective and self.policy != "cost":
            raise ValueError("objective: true is a setting of the cost policy")
        self.policy_config(0, 1.0)
        return self

    def policy_config(self, seed: int, ttft_slo_s: float) -> PolicyConfig | None:
        """The row's policy file (None: the policy's defaults); `settings` may not name `policy`
        or `seed`, which the row and the run set, and with `objective` not `cost.ttft_objective_s`,
        which is the trace's `ttft_slo_s`."""
        if self.settings is None and not self.objective:
            return None
        settings = dict(self.settings or {})
        clash = {"policy", "seed"} & set(settings)
        if clash:
            raise ValueError(f"settings may not set {sorted(clash)}: the row and the run do")
        if self.objective:
            cost = dict(settings.get("cost") or {})
            if "ttft_objective_s" in cost:
                raise ValueError("settings may not set cost.ttft_objective_s with objective: true")
            settings["cost"] = {**cost, "ttft_objective_s": ttft_slo_s}
        try:
            return PolicyConfig.model_validate({**settings, "policy": self.policy, "seed": seed})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"{self.label}: settings: {where}: {first['msg']}") from None

    def split(self) -> tuple[int, int] | None:
        """`pd` as (prefill workers, decode workers), or None for a pool of mixed workers
        (`holder_prefill` included)."""
        if self.pd is None or self.pd == HOLDER_PREFILL:
            return None
        try:
            n_prefill, n_decode = (int(part) for part in self.pd.split(":"))
        except ValueError:
            raise ValueError(f"pd takes P:D, two worker counts (e.g. 4:4), not {self.pd!r}") from None
        if n_prefill < 1 or n_decode < 1:
            raise ValueError("pd needs at least one prefill and one decode worker")
        return n_prefill, n_decode

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        return self.policy if self.pd is None else f"{self.policy} {self.pd}"

    @property
    def point_key(self) -> str:
        """What a stored point is filed under: the bare policy name for a plain row (as before P/D
        rows existed), else every field, so a renamed or changed row never reuses another's."""
        if self.name is None and self.pd is None:
            return self.policy
        return self.model_dump_json()


def as_entry(item: str | PolicyEntry) -> PolicyEntry:
    """A bare policy name is a row of `workers` mixed workers under that policy."""
    return PolicyEntry(policy=item) if isinstance(item, str) else item


class GoodputConfig(_Strict):
    """The whole benchmark. `policies` are the rows: a policy name, or a `PolicyEntry` (a P/D
    split); `baselines` are the rows (by label) every row's capacity is divided by; `subject` is
    the row the report reads against the best other one. With `stop_early`, a point above the
    reference rate stops as soon as it can no longer meet the share."""

    policies: tuple[str | PolicyEntry, ...] = Field(min_length=1)
    baselines: tuple[str, ...] = ()
    subject: str = "cost"
    goal: float | None = Field(
        1.3, gt=0
    )  # the subject's capacity over the best other row's; None: no verdict
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
        labels = self.labels()
        if len(set(labels)) != len(labels):
            raise ValueError(f"two rows share a label: {sorted(labels)}")
        unknown = [b for b in self.baselines if b not in labels]
        if unknown:
            raise ValueError(f"baselines {unknown} are not among the policies")
        for entry in self.entries():
            split = entry.split()
            if split is not None and sum(split) != self.workers:
                raise ValueError(f"{entry.label}: pd {entry.pd} has {sum(split)} workers, not {self.workers}")
        return self

    def entries(self) -> tuple[PolicyEntry, ...]:
        return tuple(as_entry(p) for p in self.policies)

    def labels(self) -> tuple[str, ...]:
        return tuple(e.label for e in self.entries())


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
        errors = exc.errors()
        # A row that is a mapping fails both branches of `str | PolicyEntry`: report the entry's.
        first = next((e for e in errors if e["type"] != "string_type"), errors[0])
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise GoodputConfigError(f"{where}: {first['msg']}") from exc


def default_config_text() -> str:
    return resources.files("loadtest.goodput").joinpath(DEFAULT_CONFIG).read_text(encoding="utf-8")


def load_goodput_config(path: str | None) -> GoodputConfig:
    """The file at `path`, or the shipped default when None; a bare name that is no file names a
    shipped config (`pd`: the P/D splits)."""
    if path is None:
        return parse_goodput_yaml(default_config_text())
    shipped = resources.files("loadtest.goodput").joinpath(f"{path}.yaml")
    if "/" not in path and not Path(path).exists() and shipped.is_file():
        return parse_goodput_yaml(shipped.read_text(encoding="utf-8"))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise GoodputConfigError(f"{path}: {exc}") from exc
    return parse_goodput_yaml(text)
