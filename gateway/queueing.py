"""A pool's waiting room: requests that find every worker at its cap wait here for a free slot.

Without it, a request arriving while every routable worker of its pool held
`max_in_flight_per_worker` requests got 503 at once. Now it waits, bounded and fairly:

    try_route(request), then if need be wait(request):
        nobody waits and the policy picks a worker       → go (the common path: one test more)
        no routable worker, or one with room that the policy passed over
                                                         → no worker: 503 as before (an outage
                                                           is not waited out)
        the tenant has `max_per_tenant` waiting          → 429 queue_full
        the pool has `max_requests` waiting              → 503 queue_full
        else wait for a turn (fair_order.py: weighted across tenants, vLLM `priority` within one)
        on its turn the policy picks again; a turn lost to a race waits again in the same place
    a worker slot frees (outcome.Attempt.end)            → one turn is handed out
    every `tick_s` while anything waits                  → waiters past `timeout_s`: 503 queue_timeout;
                                                           turns for capacity that came otherwise
                                                           (a worker turned healthy, a breaker
                                                           closed, discovery added one); no
                                                           routable worker left: every waiter gets
                                                           503 no_worker_available

While anyone waits, or holds a turn it has not used yet, a new arrival queues behind them instead
of taking a freed slot first. A turn is handed by resolving the waiter's future. A waiter whose
client leaves is cancelled by `disconnect.py` and leaves the queue; if it held a turn, the turn
goes to the next. There is no timer per request: one tick per pool, only while anything waits.

A prefill/decode pool's requests wait the same way (`try_pair`, `wait_pair`): the pair chooser
takes the policy's place, and "every worker at its cap" means no route has a free slot on each
worker it needs (`pool_capacity.py`). A slot freed by either leg hands turns for the routes then
free (`slot_freed`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from gateway.config.queue import QueueConfig
from gateway.failure import Failure
from gateway.fair_order import Entry, FairOrder
from gateway.metrics import GatewayMetrics
from gateway.pool_capacity import capacity
from gateway.registry import Pool
from policies.base import Outcome, RouteDecision, RoutingPolicy
from policies.pd import PdDecision

if TYPE_CHECKING:
    from gateway.admitted import Admitted

_FIFO = ""  # the one key of every request when `order: fifo`
_RETRY_AFTER = ((b"retry-after", b"1"),)


class _State(enum.Enum):
    WAITING = "waiting"  # in the order
    TURN = "turn"  # handed a turn, about to ask the policy
    TIMED_OUT = "timed_out"
    NO_WORKER = "no_worker"  # every routable worker went away while it waited
    CLOSED = "closed"  # the gateway's drain deadline passed while it waited
    LEFT = "left"  # its task was cancelled before its turn came
    DONE = "done"


@dataclasses.dataclass(slots=True, eq=False)
class _Waiter:
    tenant: str
    deadline_s: float
    enqueued_s: float
    future: asyncio.Future[None]
    state: _State = _State.WAITING
    entry: Entry[_Waiter] | None = None


D = TypeVar("D", RouteDecision, PdDecision)
Routed = tuple[RouteDecision | None, float]
Paired = tuple[PdDecision | None, float]
# A P/D pool's chooser: the route for the request at `now_s` (`policies.pd.PdRouter.select`).
ChoosePair = Callable[[float], PdDecision | None]


class PoolQueue:
    """The waiting room of one pool (see the module docstring). Invariants: `_waiting[t]` counts
    the tenant's waiters in `_order`, and `_turns` the waiters in state TURN."""

    def __init__(
        self,
        pool: Pool,
        config: QueueConfig,
        weights: Mapping[str, float],
        metrics: GatewayMetrics,
        tick_s: float = 0.1,
    ) -> None:
        self._pool = pool
        self._roles = pool.pd_router.settings.roles if pool.pd_router is not None else None
        self._config = config
        self._weights = weights
        self._metrics = metrics
        self.tick_s = tick_s
        self._order: FairOrder[_Waiter] = FairOrder()
        self._waiting: Counter[str] = Counter()
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._turns = 0
        self._recount_due = False  # a P/D pool's `_recount` is scheduled
        self._timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        """Requests waiting for a turn."""
        return len(self._order)

    def depths(self) -> dict[str, int]:
        """Waiting requests per tenant (tenants with none left out)."""
        return {tenant: n for tenant, n in self._waiting.items() if n}

    def try_route(self, a: Admitted, policy: RoutingPolicy) -> Routed | None:
        """The common path, without a coroutine: when nobody waits, the policy's choice of worker
        for `a` (None in it: no worker, the caller answers 503) and when it was made. None when
        the request must `wait` instead: others wait, or every routable worker is at its cap."""
        if self._order or self._turns:
            return None
        now_s = time.monotonic()
        decision = policy.select(a.route, self._pool.views(now_s), now_s)
        if decision is not None or not self._saturated(now_s):
            return decision, now_s
        return None

    async def wait(self, a: Admitted, policy: Callable[[], RoutingPolicy]) -> Routed | Failure:
        """Wait for a turn, then the choice of the policy running then (`policy()`: a reload may
        swap it while the request waits) as in `try_route`; or why the queue turned the request
        away (full, or it waited `timeout_s`)."""
        pool = self._pool
        return await self._wait(a, lambda now_s: policy().select(a.route, pool.views(now_s), now_s), True)

    def try_pair(
        self, a: Admitted, choose: ChoosePair, splittable: bool, *, whole: bool = False
    ) -> Paired | None:
        """`try_route` in a prefill/decode pool: `choose` is its pair chooser (reading `a.route`
        when called), and the pool is full when no route for the request (a pair, or one worker
        alone; only the latter when it is not `splittable`; for a `whole` request, one worker of
        the roles that serve it, `PdRoles.whole`) has a worker with a free slot."""
        if self._order or self._turns:
            return None
        now_s = time.monotonic()
        decision = choose(now_s)
        if decision is not None or not self._saturated(now_s, splittable, whole):
            return decision, now_s
        return None

    async def wait_pair(
        self, a: Admitted, choose: ChoosePair, splittable: bool, *, whole: bool = False
    ) -> Paired | Failure:
        """`wait` in a prefill/decode pool (see `try_pair`)."""
        return await self._wait(a, choose, splittable, whole)

    async def _wait(
        self, a: Admitted, choose: Callable[[float], D | None], splittable: bool, whole: bool = False
    ) -> tuple[D | None, float] | Failure:
        now_s = time.monotonic()
        refusal = self._refusal(a.tenant.name)
        if refusal is not None:
            return refusal
        waiter = self._join(a, now_s)
        if len(self._order) == 1:
            # The first to wait: turns still unused may leave capacity over (nothing else hands it).
            _, free = capacity(self._pool, self._roles, now_s)
            if free > self._turns:
                self._hand(free - self._turns)
        try:
            while True:
                await waiter.future
                if waiter.state is _State.TIMED_OUT:
                    self._waited(a, waiter, time.monotonic())
                    return self._timed_out(waiter)
                if waiter.state is _State.CLOSED:
                    self._waited(a, waiter, time.monotonic())
                    message = "gateway shutting down"
                    return Failure(503, message, "gateway_shutting_down", Outcome.ABORTED, None, _RETRY_AFTER)
                now_s = time.monotonic()
                if waiter.state is _State.NO_WORKER:
                    self._waited(a, waiter, now_s)
                    return None, now_s
                self._turns -= 1
                waiter.state = _State.DONE
                a.route = dataclasses.replace(a.route, queued_requests=len(self._order) + self._turns)
                decision = choose(now_s)
                if decision is not None or not self._saturated(now_s, splittable, whole):
                    self._waited(a, waiter, now_s)
                    return decision, now_s
                self._rejoin(waiter, a)  # a retry elsewhere took the freed slot first
        except BaseException:
            self._leave(waiter)
            self._waited(a, waiter, time.monotonic())  # its client left, or a bug
            raise

    def _waited(self, a: Admitted, waiter: _Waiter, now_s: float) -> None:
        """The request leaves the queue, whichever way (served, timed out, closed, no worker left,
        its client gone): its wait goes on its access line and into `kvgate_queue_wait_seconds`,
        so the longest waits under saturation (those that time out) are in the percentiles. The
        label is the request's tenant, a configured name."""
        waited_s = now_s - waiter.enqueued_s
        a.queued_s = waited_s
        self._metrics.queue_wait.labels(self._pool.name, waiter.tenant).observe(waited_s)

    def close(self) -> None:
        """The drain deadline: every waiter gets 503 `gateway_shutting_down` (as open streams get
        their terminal error event) instead of being cut off when the server stops."""
        while (entry := self._order.pop()) is not None:
            self._take(entry.item, _State.CLOSED)

    def slot_freed(self) -> None:
        """A request of this pool gave its worker slot back: the next waiter gets a turn. In a
        prefill/decode pool a freed slot makes a route only with a slot of the other role (a vLLM
        pair holds its decode slot from the moment it is chosen, `outcome.Reservation`, and
        one request may free both of its slots in one step): the free routes are counted once
        that step is over, and only they hand turns (a turn that finds no route costs its tenant
        its place in the fair order)."""
        if not self._order:
            return
        if self._roles is None:
            self._hand(1)
        elif not self._recount_due:
            self._recount_due = True
            asyncio.get_running_loop().call_soon(self._recount)

    def _recount(self) -> None:
        self._recount_due = False
        if self._order:
            _, free = capacity(self._pool, self._roles, time.monotonic())
            if free > self._turns:
                self._hand(free - self._turns)

    # ---------------------------------------------------------------- inside

    def _saturated(self, now_s: float, splittable: bool = True, whole: bool = False) -> bool:
        """Some worker is routable and none has a free slot: capacity will come back."""
        routable, free = capacity(self._pool, self._roles, now_s, splittable, whole)
        return routable > 0 and free == 0

    def _timed_out(self, waiter: _Waiter) -> Failure:
        self._metrics.queue_refusals.labels(self._pool.name, waiter.tenant, "timeout").inc()
        message = f"no worker slot came free within the queue timeout ({self._config.timeout_s:g} s)"
        return Failure(503, message, "queue_timeout", Outcome.ABORTED, None, _RETRY_AFTER)

    def _refusal(self, tenant: str) -> Failure | None:
        config, pool = self._config, self._pool.name
        if self._waiting[tenant] >= config.max_per_tenant:
            self._metrics.queue_refusals.labels(pool, tenant, "tenant_full").inc()
            message = f"every worker is busy and {_already_waiting(config.max_per_tenant, yours=True)}"
            return Failure(429, message, "queue_full", Outcome.ABORTED, None, _RETRY_AFTER)
        if len(self._order) >= config.max_requests:
            self._metrics.queue_refusals.labels(pool, tenant, "full").inc()
            message = f"every worker is busy and {_already_waiting(config.max_requests)}"
            return Failure(503, message, "queue_full", Outcome.ABORTED, None, _RETRY_AFTER)
        return None

    def _join(self, a: Admitted, now_s: float) -> _Waiter:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(a.tenant.name, now_s + self._config.timeout_s, now_s, future)
        self._push(waiter, a.priority)
        heapq.heappush(self._deadlines, (waiter.deadline_s, next(self._seq), waiter))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)
        return waiter

    def _push(self, waiter: _Waiter, priority: int) -> None:
        key = _FIFO if self._config.order == "fifo" else waiter.tenant
        weight = 1.0 if key == _FIFO else self._weights.get(waiter.tenant, 1.0)
        if waiter.entry is None:
            waiter.entry = self._order.push(key, weight, priority, waiter)
        else:
            self._order.restore(waiter.entry, weight)
        self._waiting[waiter.tenant] += 1

    def _rejoin(self, waiter: _Waiter, a: Admitted) -> None:
        waiter.future = asyncio.get_running_loop().create_future()
        waiter.state = _State.WAITING
        self._push(waiter, a.priority)
        # Its deadline may have been swept while it held the turn: it counts again.
        heapq.heappush(self._deadlines, (waiter.deadline_s, next(self._seq), waiter))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)

    def _leave(self, waiter: _Waiter) -> None:
        """The waiter's task ends (cancelled, or a bug): out of the queue, its turn passed on."""
        if waiter.state is _State.WAITING:
            assert waiter.entry is not None
            self._order.remove(waiter.entry)
            self._waiting[waiter.tenant] -= 1
        elif waiter.state is _State.TURN:
            self._turns -= 1
            self._hand(1)
        waiter.state = _State.DONE

    def _take(self, waiter: _Waiter, state: _State) -> None:
        """Take a waiting waiter out of the order (popped already, or removed here) into `state`."""
        if waiter.entry is not None and waiter.entry.live:
            self._order.remove(waiter.entry)
        self._waiting[waiter.tenant] -= 1
        waiter.state = state
        if not waiter.future.done():
            waiter.future.set_result(None)

    def _hand(self, turns: int) -> None:
        """Hand up to `turns` turns to the next waiters in fair order."""
        while turns > 0:
            entry = self._order.pop()
            if entry is None:
                return
            waiter = entry.item
            if waiter.future.done():
                # Cancelled (its client left) but its task has not run yet: it only leaves.
                self._take(waiter, _State.LEFT)
                continue
            self._take(waiter, _State.TURN)
            self._turns += 1
            turns -= 1

    def _tick(self) -> None:
        now_s = time.monotonic()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_s:
            waiter = heapq.heappop(deadlines)[2]
            if waiter.state is _State.WAITING:
                self._take(waiter, _State.TIMED_OUT)
        if self._order:
            routable, free = capacity(self._pool, self._roles, now_s)
            if routable == 0:
                while (entry := self._order.pop()) is not None:
                    self._take(entry.item, _State.NO_WORKER)
            elif free > self._turns:
                self._hand(free - self._turns)
        if self._order:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)
        else:
            self._timer = None
            deadlines.clear()  # nobody waits: what is left belongs to waiters already gone

    def check_invariants(self) -> None:
        """The counters agree with the order."""
        self._order.check_invariants()
        assert sum(self._waiting.values()) == len(self._order) and self._turns >= 0


def build_queues(
    pools: Mapping[str, Pool], weights: Mapping[str, float], metrics: GatewayMetrics
) -> dict[str, PoolQueue]:
    """One queue per pool whose `queue.enabled`; the depth gauge is refreshed at scrape time,
    0 for a configured tenant with nothing waiting (a series that vanished when a queue emptied
    would read as "no data", not as an empty queue). So its series are the queued pools times
    the tenants (`weights` names each configured tenant)."""
    queues = {
        name: PoolQueue(pool, pool.config.queue, weights, metrics)
        for name, pool in pools.items()
        if pool.config.queue.enabled
    }

    def refresh_depths() -> None:
        metrics.queue_depth.clear()
        for name, queue in queues.items():
            depths = queue.depths()
            for tenant in weights.keys() | depths.keys():
                metrics.queue_depth.labels(name, tenant).set(depths.get(tenant, 0))

    metrics.before_scrape.append(refresh_depths)
    return queues


def _already_waiting(count: int, yours: bool = False) -> str:
    """ "1 of your requests is already waiting", "3 requests are already waiting"."""
    verb = "is" if count == 1 else "are"
    if yours:
        return f"{count} of your requests {verb} already waiting"
    return f"{count} request{'' if count == 1 else 's'} {verb} already waiting"
