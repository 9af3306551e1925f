"""Stop a point early once it can no longer meet the attainment share.

`SloWatch` wraps the policy under test and passes every call through unchanged; it also judges
each request as the loop reports it (a refused route, or a completion with its TTFT, finish time
and output tokens, which give the same TPOT as the request record) and raises `PointHopeless` as
soon as more requests have missed the SLOs than the share allows. A rate far above a policy's
capacity then costs a fraction of a full replay; the search only needs to know that it fails.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from policies.base import (
    KvEvent,
    Observation,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerId,
    WorkerView,
)


class PointHopeless(Exception):
    """More requests missed the SLOs than the attainment share allows; `n_missed` so far."""

    def __init__(self, n_missed: int) -> None:
        super().__init__(f"{n_missed} requests missed the SLOs")
        self.n_missed = n_missed


class SloWatch:
    """A pass-through `RoutingPolicy` that counts SLO misses (see the module doc)."""

    name: ClassVar[str] = "slo-watch"

    def __init__(
        self,
        inner: RoutingPolicy,
        arrivals_s: Mapping[str, float],
        *,
        ttft_slo_s: float,
        tpot_slo_s: float,
        share: float,
    ) -> None:
        self.inner = inner
        self._arrivals_s = arrivals_s
        self._ttft_slo_s = ttft_slo_s
        self._tpot_slo_s = tpot_slo_s
        n = len(arrivals_s)
        self.max_missed = n - math.ceil(share * n - 1e-9)
        self.n_missed = 0

    def _miss(self) -> None:
        self.n_missed += 1
        if self.n_missed > self.max_missed:
            raise PointHopeless(self.n_missed)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        decision = self.inner.select(req, workers, now_s)
        if decision is None:
            self._miss()
        return decision

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        self.inner.on_dispatch(req, decision, now_s)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self.inner.on_complete(obs, now_s)
        if obs.failed or obs.ttft_s is None:
            self._miss()
            return
        out = obs.completion_tokens or 0
        first_s = self._arrivals_s[obs.request.request_id] + obs.ttft_s
        tpot_s = (now_s - first_s) / (out - 1) if out >= 2 else None
        if obs.ttft_s > self._ttft_slo_s or (tpot_s is not None and tpot_s > self._tpot_slo_s):
            self._miss()

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        self.inner.on_kv_event(worker, event, now_s)
