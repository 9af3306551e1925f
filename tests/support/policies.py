"""A base for the stub routing policies tests write: the feedback hooks a stub does not use."""

from __future__ import annotations

from policies.base import KvEvent, Observation, RouteDecision, RouteRequest, WorkerId


class IgnoresFeedback:
    """`RoutingPolicy`'s feedback hooks as no-ops; a stub subclasses it and writes `select` (and
    overrides whichever hook it records)."""

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        return None

    def on_complete(self, obs: Observation, now_s: float) -> None:
        return None

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        return None
