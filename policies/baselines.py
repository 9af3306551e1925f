"""Load-only baselines: round_robin and least_load. They ignore prefixes entirely."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policies.base import KvEvent, Observation, RouteDecision, RouteRequest, WorkerId, WorkerView
from policies.registry import register_policy


def _available(workers: Sequence[WorkerView]) -> list[WorkerView]:
    return [
        w
        for w in workers
        if w.healthy and (w.max_in_flight is None or w.in_flight_requests < w.max_in_flight)
    ]


class _Stateless:
    """Feedback hooks that load-only policies do not need."""

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        return None

    def on_complete(self, obs: Observation, now_s: float) -> None:
        return None

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        return None


@register_policy("round_robin")
class RoundRobin(_Stateless):
    """Cycle through available workers in the order given."""

    name: ClassVar[str]

    def __init__(self, *, seed: int = 0) -> None:
        self._next = 0

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        candidates = _available(workers)
        if not candidates:
            return None
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return RouteDecision(chosen.worker_id, 0.0, "round_robin")


@register_policy("least_load")
class LeastLoad(_Stateless):
    """Fewest in-flight requests, then fewest in-flight prefill tokens; ties go to the earlier worker."""

    name: ClassVar[str]

    def __init__(self, *, seed: int = 0) -> None:
        pass

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        candidates = _available(workers)
        if not candidates:
            return None
        chosen = min(candidates, key=lambda w: (w.in_flight_requests, w.in_flight_prefill_tokens))
        return RouteDecision(chosen.worker_id, -float(chosen.in_flight_requests), "least_load")
