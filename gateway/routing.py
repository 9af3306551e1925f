"""The routing policy and what hears of every routed request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.decision_log import DecisionLog
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.queueing import PoolQueue
from gateway.tracing import RequestTracer
from policies.base import RouteRequest, RoutingPolicy
from policies.peer_sync import SupportsHold


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
    # Whether the policy applies workers' KV events (precise mode, `precise.py`); when it does not,
    # the subscriber drops them undecoded.
    kv_events_used: bool = True
    # Tasks a request leaves running after its answer (an SGLang prefill leg read to its end
    # apart, `pd_pairs`): the lifespan cancels and awaits them at stop (`stop_background`).
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # The policy `hold_s` last checked, and it as one that may hold (None: it never holds).
    _hold_checked: RoutingPolicy | None = field(default=None, init=False, repr=False)
    _holder: SupportsHold | None = field(default=None, init=False, repr=False)

    def run_in_background(self, task: asyncio.Task[None]) -> None:
        """Keep `task` (done, it leaves) until the gateway stops."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def stop_background(self) -> None:
        """Cancel the tasks still running in the background and wait for them to end."""
        tasks = list(self.background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def swap(self, policy: RoutingPolicy) -> RoutingPolicy:
        """Make `policy` the current one (a reload); returns the one it replaces, which nothing
        here keeps (the hold check made for it is forgotten)."""
        previous, self.policy = self.policy, policy
        self._hold_checked = self._holder = None
        return previous

    def hold_s(self, route: RouteRequest, now_s: float) -> float:
        """How long to hold `route` before deciding it (`SupportsHold`: peers' decisions of the
        same instant reach this gateway first); 0 with a policy that never holds. The protocol
        check is made once per policy, not per request."""
        policy = self.policy
        if policy is not self._hold_checked:
            self._hold_checked = policy
            self._holder = policy if isinstance(policy, SupportsHold) else None
        return 0.0 if self._holder is None else self._holder.hold_s(route, now_s)

    @property
    def policy_name(self) -> str:
        return getattr(self.policy, "name", type(self.policy).__name__)
