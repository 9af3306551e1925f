"""Stop a point early once it can no longer meet the attainment share.

`SloWatch` wraps the policy under test and passes every call through unchanged; it also judges
each request as the loop reports it (a refused route, or a completion with its TTFT, finish time
and output tokens, which give the same TPOT as the request record) and raises `PointHopeless` as
soon as more requests have missed the SLOs than the share allows. A rate far above a policy's
capacity then costs a fraction of a full replay; the search only needs to know that it fails.

Closed loop a request is sent when the answers it follows have come and its think time has
passed, not at the arrival the trace gives it: its TTFT counts from when it was sent, which is
when it is first routed (`closed_loop`: the watch notes that time at the request's first
`select`), so that its TPOT is judged from its own first token.

In a P/D pool the policy hears of a request twice, its prefill leg (one token) and then its
answer, so misses are counted per request: a prefill leg that missed the TTFT objective means the
answer misses it too. A refused route is not a miss there (the pair chooser may still run the
request alone); the watch can only count too few misses, never too many, so a point it stops has
failed for certain.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, cast

from policies.base import (
    KvEvent,
    Observation,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerId,
    WorkerView,
)
from policies.cost_model import CostModel
from policies.pd import MovesKvAware, PrefixHolder


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
        pd: bool = False,
        closed_loop: bool = False,
    ) -> None:
        self.inner = inner
        self._pd = pd
        # Closed loop: when each request in flight was sent (its first `select`).
        self._sent_s: dict[str, float] | None = {} if closed_loop else None
        self._arrivals_s = arrivals_s
        self._ttft_slo_s = ttft_slo_s
        self._tpot_slo_s = tpot_slo_s
        n = len(arrivals_s)
        self.max_missed = n - math.ceil(share * n - 1e-9)
        self._missed: set[str] = set()

    @property
    def n_missed(self) -> int:
        return len(self._missed)

    def _miss(self, request_id: str) -> None:
        self._missed.add(request_id)
        if len(self._missed) > self.max_missed:
            raise PointHopeless(len(self._missed))

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        if self._sent_s is not None:
            self._sent_s.setdefault(req.request_id, now_s)
        decision = self.inner.select(req, workers, now_s)
        if decision is None and not self._pd:
            self._miss(req.request_id)
        return decision

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        self.inner.on_dispatch(req, decision, now_s)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self.inner.on_complete(obs, now_s)
        rid = obs.request.request_id
        if obs.failed or obs.ttft_s is None:
            self._miss(rid)
            return
        out = obs.completion_tokens or 0
        sent_s = self._arrivals_s[rid]
        if self._sent_s is not None:
            # (Kept after it completes: a P/D request completes twice. Bounded as `arrivals_s` is.)
            sent_s = self._sent_s.get(rid, sent_s)
        first_s = sent_s + obs.ttft_s
        tpot_s = (now_s - first_s) / (out - 1) if out >= 2 else None
        if obs.ttft_s > self._ttft_slo_s or (tpot_s is not None and tpot_s > self._tpot_slo_s):
            self._miss(rid)

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        self.inner.on_kv_event(worker, event, now_s)


class _HolderSloWatch(SloWatch):
    """A `SloWatch` around a policy that keeps a prefix index: P/D routing asks the policy what
    each worker holds and for its cost model (`policies.pd.PrefixHolder`), and tells it of pools
    that move KV (`policies.pd.MovesKvAware`), so the watch answers and passes on for it."""

    def held_tokens(
        self, req: RouteRequest, shared_prefix_blocks: int, now_s: float
    ) -> Mapping[WorkerId, int]:
        return cast(PrefixHolder, self.inner).held_tokens(req, shared_prefix_blocks, now_s)

    def cost_model(self, req: RouteRequest) -> CostModel:
        return cast(PrefixHolder, self.inner).cost_model(req)

    # `holder_prefill` tells the policy its pool moves KV and asks how it counts backlogs
    # (`policies.pd.MovesKvAware`); the runtime Protocol check is made once, not per decision.
    def pool_moves_kv(self, pool: str) -> None:
        if self._kv_aware is not None:
            self._kv_aware.pool_moves_kv(pool)

    def backlog_share(self, pool: str, worker: WorkerId) -> float:
        return 1.0 if self._kv_aware is None else self._kv_aware.backlog_share(pool, worker)

    @functools.cached_property
    def _kv_aware(self) -> MovesKvAware | None:
        return self.inner if isinstance(self.inner, MovesKvAware) else None


def watch_policy(
    inner: RoutingPolicy,
    arrivals_s: Mapping[str, float],
    *,
    ttft_slo_s: float,
    tpot_slo_s: float,
    share: float,
    pd: bool = False,
    closed_loop: bool = False,
) -> SloWatch:
    """`inner` watched; a prefix holder stays one, so P/D routing decides as it would unwatched."""
    kind = _HolderSloWatch if isinstance(inner, PrefixHolder) else SloWatch
    return kind(
        inner,
        arrivals_s,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        share=share,
        pd=pd,
        closed_loop=closed_loop,
    )
