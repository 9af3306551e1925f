"""Several gateways in front of one pool, in virtual time: a balancer and the sync between them.

An L4 balancer spreads connections, not sessions. Each request picks its gateway by a seeded hash
of its request id (one connection per request, as from a frontend's shared client pool): a
session's turns land on gateways independently of each other, so two turns of a conversation meet
on the same gateway only by chance (1/N), the case where independent gateways lose most. The hash
is of the request alone, so a run is the same whatever else is in the trace.

Each `SimGateway` has its own policy object (its own index), its own in-flight accounting per
worker, and the load its peers reported. With `SyncBus`, every item a gateway's policy publishes,
and each change of its in-flight load on a worker, reaches every other gateway `delay_s` later
(the broker's publish-to-apply latency, batching included), in publication order. A request
its gateway holds before deciding (`SupportsHold`) is decided when the hold ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import xxhash

from policies.base import RouteRequest, RoutingPolicy, WorkerId, WorkerView
from policies.peer_sync import (
    PeerItem,
    PeerLoad,
    PeerLoads,
    SupportsHold,
    SupportsPeerSync,
    SyncSink,
    with_peer_load,
)


class SimGateway:
    """One gateway: its policy and what it knows of each worker's load (by worker index).

    `views` holds each worker's last `WorkerView` as this gateway built it, as the gateway's
    registry keeps one: a worker's entry is cleared when the accounting (`dispatched`,
    `first_token`, `finished`) or the scrape behind it (`views.GatewayViews`) changes, so a
    decision rebuilds only the views that changed.
    """

    __slots__ = (
        "context", "decode", "holder", "in_flight", "index", "name", "pairs", "peer_loads", "policy",
        "prefill", "prefill_started", "views",
    )  # fmt: skip

    def __init__(self, index: int, policy: RoutingPolicy, n_workers: int) -> None:
        self.index = index
        self.name = f"gw{index}"
        self.policy = policy
        self.holder = policy if isinstance(policy, SupportsHold) else None
        self.in_flight = [0] * n_workers
        self.prefill = [0] * n_workers
        self.pairs = [0] * n_workers  # prefill attention (`WorkerView.in_flight_prefill_pairs`)
        # When each worker's prefill backlog (as this gateway counts it) last restarted, as the
        # registry keeps it (`WorkerView.prefill_started_s`).
        self.prefill_started: list[float | None] = [None] * n_workers
        self.decode = [0] * n_workers
        self.context = [0] * n_workers  # decode context tokens (`WorkerView.decode_context_tokens`)
        self.views: list[WorkerView | None] = [None] * n_workers
        self.peer_loads: PeerLoads | None = None

    def dispatched(self, i: int, prompt_tokens: int, pairs: int, max_out: int, now_s: float) -> None:
        """A request went to worker `i`: its prompt joins the prefill backlog (which restarts if it
        was empty) and its output tokens to come count from now, as the gateway's registry counts
        them."""
        self.in_flight[i] += 1
        if self.prefill[i] <= 0 < prompt_tokens:
            self.prefill_started[i] = now_s
        self.prefill[i] += prompt_tokens
        self.pairs[i] += pairs
        self.decode[i] += max_out
        self.views[i] = None

    def first_token(self, i: int, prompt_tokens: int, pairs: int, context: int, now_s: float) -> None:
        """A request's first token on worker `i`: its prompt leaves the prefill backlog and its
        `context` (`decode_context_of`) joins the decode context."""
        self.prefill[i] -= prompt_tokens
        self.pairs[i] -= pairs
        self.context[i] += context
        self.prefill_started[i] = now_s if self.prefill[i] > 0 else None
        self.views[i] = None

    def finished(self, i: int, max_out: int, context: int) -> None:
        """A request on worker `i` finished: it leaves the in-flight count and the decode terms."""
        self.decode[i] -= max_out
        self.context[i] -= context
        self.in_flight[i] -= 1
        self.views[i] = None

    def hold_s(self, route: RouteRequest, now_s: float) -> float:
        """How long the gateway holds `route` before deciding it (`SupportsHold`)."""
        return 0.0 if self.holder is None else self.holder.hold_s(route, now_s)

    def load(self, pool: str, worker: WorkerId, i: int) -> PeerLoad:
        return PeerLoad(
            pool, worker, self.in_flight[i], self.prefill[i], self.decode[i], self.context[i], self.pairs[i]
        )

    def fold(self, pool: str, view: WorkerView) -> WorkerView:
        """`view` (this gateway's own accounting) plus what its peers reported."""
        loads = self.peer_loads
        if loads is None or not loads.any:
            return view
        return with_peer_load(view, loads.total(pool, view.worker_id))


def pick_gateway(request_id: str, n_gateways: int, seed: int) -> int:
    """The gateway a request's connection lands on (see the module docstring)."""
    if n_gateways == 1:
        return 0
    return xxhash.xxh64_intdigest(request_id.encode(), seed=seed) % n_gateways


class SyncBus:
    """The broker: delivers each published item to every other gateway `delay_s` after it was sent.

    Items are queued in publication order and all take the same delay, so the queue stays sorted by
    due time. Invariant: a gateway never receives its own items.
    """

    def __init__(self, gateways: Sequence[SimGateway], delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        self.gateways = gateways
        self.delay_s = delay_s
        self.queue: deque[tuple[float, int, PeerItem | PeerLoad]] = deque()
        self.published = 0
        self.delivered = 0
        for gw in gateways:
            gw.peer_loads = PeerLoads()  # never expired here: the broker loses nothing
            if isinstance(gw.policy, SupportsPeerSync):
                gw.policy.set_sync_sink(self._sink(gw.index), origin=gw.name)

    def _sink(self, origin: int) -> SyncSink:
        def publish(item: PeerItem, now_s: float) -> None:
            self.queue.append((now_s + self.delay_s, origin, item))
            self.published += 1

        return publish

    def load_changed(self, gw: SimGateway, pool: str, worker: WorkerId, i: int, now_s: float) -> None:
        """Publish `gw`'s in-flight load on worker `i` (it just changed)."""
        self.queue.append((now_s + self.delay_s, gw.index, gw.load(pool, worker, i)))
        self.published += 1

    @property
    def next_due_s(self) -> float:
        return self.queue[0][0] if self.queue else float("inf")

    def deliver_due(self, until_s: float) -> None:
        """Deliver every item due at or before `until_s`."""
        queue = self.queue
        while queue and queue[0][0] <= until_s:
            due_s, origin, item = queue.popleft()
            name = self.gateways[origin].name
            for gw in self.gateways:
                if gw.index == origin:
                    continue
                self.delivered += 1
                if isinstance(gw.policy, SupportsPeerSync):
                    gw.policy.note_peer(name, due_s)
                if isinstance(item, PeerLoad):
                    assert gw.peer_loads is not None
                    gw.peer_loads.note(name, (item,), due_s, full=False)
                elif isinstance(gw.policy, SupportsPeerSync):
                    gw.policy.apply_peer(name, item, due_s, due_s - self.delay_s)
