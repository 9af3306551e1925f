"""The routing policy and what hears of every routed request."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.decision_log import DecisionLog
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.queueing import PoolQueue
from gateway.tracing import RequestTracer
from policies.base import RouteRequest, RoutingPolicy
from policies.peer_sync import SupportsPeerSync


@dataclass(slots=True)
class Routing:
    """What dispatch (`proxy`, `pd`) and the books (`outcome`) share: the policy that picks a
    worker and learns from each outcome, the pools' waiting rooms (a closed attempt frees a
    slot), the metrics, the access log and, when they are on, the tracer and the decision log.

    This is the one holder of the current policy: a reload swaps it here (`GatewayState.set_policy`)
    and every reader asks this object each time, so none keeps the old policy."""

    policy: RoutingPolicy
    metrics: GatewayMetrics
    queues: dict[str, PoolQueue] = field(default_factory=dict)  # pool name -> its waiting room
    access_log: AccessLog = field(default_factory=lambda: AccessLog(enabled=False))
    tracer: RequestTracer | None = None
    decision_log: DecisionLog | None = None  # config `decision_log.path`; None: off
    # The policy `hold_s` last looked at, and it as a syncing policy (None: it does not sync).
    _held_for: RoutingPolicy | None = field(default=None, init=False, repr=False)
    _syncing: SupportsPeerSync | None = field(default=None, init=False, repr=False)

    def hold_s(self, route: RouteRequest, now_s: float) -> float:
        """How long to hold `route` before deciding it (`SupportsPeerSync.hold_s`: peers' decisions
        of the same instant reach this gateway first); 0 with a policy that does not sync. The
        protocol check is made once per policy, not per request."""
        policy = self.policy
        if policy is not self._held_for:
            self._held_for = policy
            self._syncing = policy if isinstance(policy, SupportsPeerSync) else None
        return 0.0 if self._syncing is None else self._syncing.hold_s(route, now_s)

    @property
    def policy_name(self) -> str:
        return getattr(self.policy, "name", type(self.policy).__name__)
