"""A policy wrapper that asks the simulator's policy for its choice, then places the request where
the HTTP run placed it.

Forcing the HTTP run's placements keeps the simulated caches, the index and the load the same as
the HTTP run's, so each decision is compared on the same history: a divergence is then the
signals' doing (the load view, the predicted hit), not an earlier divergence's consequence. The
policy still learns from its own dispatches and completions as in a free simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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

HeldTokens = Callable[[RouteRequest, int, float], dict[WorkerId, int]]


@dataclass(frozen=True, slots=True)
class SimDecision:
    """What the simulator's policy chose for a request, and the view it chose on."""

    request_id: str
    t_s: float
    worker: str | None
    reason: str
    predicted: Mapping[str, int]  # predicted cached tokens per worker (request tokens)
    views: Mapping[str, WorkerView]
    n_prompt_tokens: int


class ForcedPolicy:
    """Records `inner`'s decision for every request, then routes it to `forced[request_id]` when
    given (the request id is the workload's)."""

    name: ClassVar[str] = "forced"

    def __init__(self, inner: RoutingPolicy, forced: Mapping[str, str] | None) -> None:
        self.inner = inner
        self.forced = forced
        self.decisions: dict[str, SimDecision] = {}
        self._held: HeldTokens | None = getattr(inner, "held_tokens", None)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        predicted = self._held(req, 0, now_s) if self._held is not None else {}
        decision = self.inner.select(req, workers, now_s)
        self.decisions[req.request_id] = SimDecision(
            req.request_id,
            now_s,
            decision.worker if decision is not None else None,
            decision.reason if decision is not None else "none",
            {str(w): n for w, n in predicted.items()},
            {str(v.worker_id): v for v in workers},
            req.n_prompt_tokens,
        )
        target = self.forced.get(req.request_id) if self.forced is not None else None
        if target is None or decision is None or decision.worker == target:
            return decision
        matched = predicted.get(WorkerId(target), 0)
        return RouteDecision(WorkerId(target), decision.score_s, "forced", matched, 0)

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        self.inner.on_dispatch(req, decision, now_s)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self.inner.on_complete(obs, now_s)

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        self.inner.on_kv_event(worker, event, now_s)
