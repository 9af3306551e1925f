"""Routing policies: prefix index, cost model, scorers, tenant namespaces, hot-prefix logic.

Policies are sync and pure: no I/O, no wall clock (time arrives as `now_s`), so the gateway and the
simulator run the very same objects.
"""

from policies.base import (
    KvEvent,
    KvEventKind,
    Observation,
    Outcome,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerId,
    WorkerView,
)
from policies.registry import known_policies, make_policy, register_policy

__all__ = [
    "KvEvent",
    "KvEventKind",
    "Observation",
    "Outcome",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "WorkerId",
    "WorkerView",
    "known_policies",
    "make_policy",
    "register_policy",
]
