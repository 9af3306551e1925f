"""Replica sync, the policy's side: what one gateway publishes and how another applies it.

Several gateways (replicas, or processes of one replica) route to the same workers. KV events and
scraped metrics give each of them the workers' truth, but late (after a prefill) or coarse (one
scrape a second); what happens between a decision and its evidence is known to the gateway that
decided. Sync publishes exactly that, as keys and counts, never content:

- `PeerHolding`: the origin routed a request, so `worker` will compute chain `keys` in `namespace`
  of `pool`. A receiver records it as a speculative holding, as it records its own dispatches
  (same TTL, counted from when it applies the holding: gateways' clocks are not comparable).
- `PeerOutcome`: how that request ended. Served confirms the holding in place, as a local
  completion does; any failure takes its unconfirmed blocks back.
- `PeerCalibration`: what one of the origin's completions taught its cost model (prompt sizes, the
  observed over predicted prefill time). A receiver folds it into its own calibration, so every
  gateway learns from every completion, as one gateway in front of the same traffic would.
- `PeerLoad`: the origin's in-flight requests and tokens on one worker of one pool, a snapshot
  that replaces the origin's previous one. `PeerLoads` sums the snapshots per worker, and
  `with_peer_load` adds the sum to the `WorkerView` a policy scores.

A policy publishes through a `SyncSink` (`set_sync_sink`, calibration samples only when asked);
with none set (the default) its decision path pays one attribute test. `PeerRouting` keeps,
bounded, the references that pair an outcome with its holding on both sides.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import field, replace
from typing import Protocol, runtime_checkable

from policies.base import RouteRequest, WorkerId, WorkerView
from policies.records import record
from prompt_normalizer.types import BlockKey


@record
class PeerHolding:
    """A routing decision as peers apply it: chain `keys` (chained prefix keys, in order from block
    0) of `namespace` in `pool` will be computed by `worker`. `ref` names the dispatch for its
    outcome; the token counts let a peer account the prefill work routed to the worker."""

    ref: int
    pool: str
    block_size_tokens: int
    namespace: str
    keys: tuple[BlockKey, ...]
    worker: WorkerId
    n_prompt_tokens: int
    matched_tokens: int


@record
class PeerOutcome:
    """How the dispatch `ref` ended: `served` (the worker computed every block) or not."""

    ref: int
    served: bool


@record
class PeerCalibration:
    """One completion's calibration sample (`policies.cost_model.CalibrationSample`) in `pool`:
    the engine's prompt tokens, the request's estimate of them and observed over predicted prefill
    time, each 0 when unknown. Numbers only."""

    pool: str
    block_size_tokens: int
    prompt_tokens: int
    request_tokens: int
    scale_ratio: float


@record
class PeerLoad:
    """One gateway's in-flight load on one worker of one pool (its own accounting, a snapshot).

    `prefill_since_s` is not sent: a receiver sets it, on its own clock, to when the origin's
    load there last changed (`PeerLoads.note`). The origin's prefill work restarts only with such a
    change, so no progress counted from then on (`WorkerView.prefill_started_s`) can exceed the
    origin's own; None: no progress is counted. A receiver's annotation, left out of equality."""

    pool: str
    worker: WorkerId
    requests: int
    prefill_tokens: int
    decode_tokens: int
    decode_context_tokens: int = 0  # `WorkerView.decode_context_tokens` of the origin's requests
    prefill_pairs: int = 0  # `WorkerView.in_flight_prefill_pairs` of the origin's requests
    prefill_since_s: float | None = field(default=None, compare=False)

    @property
    def idle(self) -> bool:
        return self.requests <= 0 and self.prefill_tokens <= 0 and self.decode_tokens <= 0

    @property
    def counts(self) -> LoadCounts:
        """The load's numbers, in field order (what `PeerLoads` sums, what a publisher compares)."""
        return (
            self.requests,
            self.prefill_tokens,
            self.decode_tokens,
            self.decode_context_tokens,
            self.prefill_pairs,
        )


# requests, prefill tokens, decode tokens, decode context tokens, prefill pairs (`PeerLoad.counts`)
LoadCounts = tuple[int, int, int, int, int]
NO_LOAD: LoadCounts = (0, 0, 0, 0, 0)


PeerItem = PeerHolding | PeerOutcome | PeerCalibration
# Called by a policy for each item it publishes, with the policy's `now_s`.
SyncSink = Callable[[PeerItem, float], None]


@runtime_checkable
class SupportsPeerSync(Protocol):
    """A policy that publishes its decisions and applies its peers' (the prefix-index policies).

    Runtime-checkable: a class missing any member below is not taken for one, and then neither
    publishes nor receives anything."""

    def set_sync_sink(
        self, sink: SyncSink | None, *, calibration: bool = False, origin: str = ""
    ) -> None: ...

    def apply_peer(
        self, origin: str, item: PeerItem, now_s: float, decided_s: float | None = None
    ) -> None: ...

    def note_peer(self, origin: str, now_s: float) -> None:
        """Gateway `origin` was heard from (any batch, its load refreshes included)."""
        ...

    @property
    def unseen_peer_dispatches(self) -> float:
        """Peer dispatches one decision of this policy could not see yet (`policies.herd`)."""
        ...


@runtime_checkable
class SupportsHold(Protocol):
    """A policy that may ask for a request to be held before it is decided, so that its peers'
    decisions of the same instant reach it first (`policies.herd`). Its own protocol: a policy
    that syncs without it still syncs."""

    def hold_s(self, req: RouteRequest, now_s: float) -> float:
        """Seconds to hold `req` before deciding it (0: decide now)."""
        ...


class PeerRouting:
    """One policy's sync bookkeeping: the ref of each of its own dispatches still running (so its
    outcome can name it) and the peers' holdings still waiting for their outcomes.

    Both maps are bounded (oldest first out), the peers' holdings also by their keys in all (what
    they cost in memory, a peer choosing their length): an outcome that finds no holding is
    dropped, and the holding it would have settled expires with its TTL, as a lost message would
    leave it. Invariant: `_peer_keys` is the sum of the remembered holdings' keys.
    """

    MAX_PENDING = 65_536
    MAX_PENDING_KEYS = 1 << 21  # ~16 per pending holding at the count bound: typical chains fit

    __slots__ = ("_next_ref", "_own", "_peer", "_peer_keys", "counters")

    def __init__(self) -> None:
        self._next_ref = 0
        self._own: OrderedDict[str, int] = OrderedDict()
        self._peer: OrderedDict[tuple[str, int], PeerHolding] = OrderedDict()
        self._peer_keys = 0
        self.counters: dict[str, int] = {}

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def dispatched(self, request_id: str) -> int:
        """A new ref for this dispatch of `request_id` (a retry replaces the earlier one)."""
        self._next_ref += 1
        own = self._own
        own.pop(request_id, None)
        own[request_id] = self._next_ref
        if len(own) > self.MAX_PENDING:
            own.popitem(last=False)
        return self._next_ref

    def finished(self, request_id: str) -> int | None:
        """The ref of `request_id`'s running dispatch, now settled (None: not published)."""
        return self._own.pop(request_id, None)

    def remember(self, origin: str, holding: PeerHolding) -> None:
        self.settle(origin, holding.ref)  # a ref seen again replaces its holding
        peer = self._peer
        peer[(origin, holding.ref)] = holding
        self._peer_keys += len(holding.keys)
        while len(peer) > self.MAX_PENDING or self._peer_keys > self.MAX_PENDING_KEYS:
            _, oldest = peer.popitem(last=False)
            self._peer_keys -= len(oldest.keys)

    def settle(self, origin: str, ref: int) -> PeerHolding | None:
        """The holding a peer's outcome settles, if still remembered."""
        held = self._peer.pop((origin, ref), None)
        if held is not None:
            self._peer_keys -= len(held.keys)
        return held

    def pending(self) -> tuple[int, int]:
        """(own dispatches awaiting an outcome, peers' holdings awaiting theirs)."""
        return len(self._own), len(self._peer)

    def check_invariants(self) -> None:
        assert self._peer_keys == sum(len(h.keys) for h in self._peer.values()), "pending keys drifted"
        assert len(self._peer) <= self.MAX_PENDING and self._peer_keys <= self.MAX_PENDING_KEYS


_Slot = tuple[str, WorkerId]


class PeerLoads:
    """Peers' in-flight snapshots, summed per (pool, worker).

    A peer not heard from for `ttl_s` is forgotten with its loads, so a gateway that died or was
    cut off stops weighing on the workers it used; so is the one heard from least recently when a
    new peer would make more than `MAX_PEERS` (the bus is open: a name costs nothing to make up).
    Invariant (`check_invariants`): `_sums[s]` is the sum over origins of their snapshot at `s`,
    and holds only slots with load.
    """

    MAX_PEERS = 1024

    def __init__(self, ttl_s: float = 3.0) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_s = ttl_s
        self._heard: dict[str, float] = {}
        self._by_origin: dict[str, dict[_Slot, PeerLoad]] = {}
        self._sums: dict[_Slot, LoadCounts] = {}

    def note(self, origin: str, loads: Iterable[PeerLoad], now_s: float, *, full: bool) -> set[_Slot]:
        """Apply `origin`'s snapshots: `full` means they are all its load (a slot it leaves out is
        idle), otherwise only the slots listed changed. Returns the slots whose sum changed."""
        changed: set[_Slot] = set()
        heard = self._heard
        if heard.pop(origin, None) is None and len(heard) >= self.MAX_PEERS:
            self._forget(next(iter(heard)), changed)  # the one heard from least recently
        heard[origin] = now_s  # kept in the order last heard
        mine = self._by_origin.setdefault(origin, {})
        before = dict(mine) if full else mine  # unchanged slots keep their restart times
        if full:
            for slot in list(mine):
                self._put(mine, slot, None, changed)
        for load in loads:
            slot = (load.pool, load.worker)
            if not load.idle:
                old = before.get(slot)
                kept = old is not None and (old.requests, old.prefill_tokens) == (
                    load.requests,
                    load.prefill_tokens,
                )
                load = replace(load, prefill_since_s=old.prefill_since_s if kept and old else now_s)
            self._put(mine, slot, None if load.idle else load, changed)
        if not mine:
            del self._by_origin[origin]
        return changed

    def _put(
        self, mine: dict[_Slot, PeerLoad], slot: _Slot, load: PeerLoad | None, changed: set[_Slot]
    ) -> None:
        old = mine.pop(slot, None)
        if old is None and load is None:
            return
        sums = self._sums.get(slot, NO_LOAD)
        if old is not None:
            sums = _add(sums, old.counts, -1)
        if load is not None:
            mine[slot] = load
            sums = _add(sums, load.counts, 1)
        if any(sums):
            self._sums[slot] = sums
        else:
            self._sums.pop(slot, None)
        changed.add(slot)

    def expire(self, now_s: float) -> set[_Slot]:
        """Forget peers silent for `ttl_s`; returns the slots whose sum changed."""
        changed: set[_Slot] = set()
        for origin, heard in list(self._heard.items()):
            if now_s - heard < self.ttl_s:
                continue
            self._forget(origin, changed)
        return changed

    def forget(self, origin: str) -> set[_Slot]:
        """Forget `origin` and its load now (it is not a peer after all); returns the slots whose
        sum changed."""
        changed: set[_Slot] = set()
        if origin in self._heard:
            self._forget(origin, changed)
        return changed

    def _forget(self, origin: str, changed: set[_Slot]) -> None:
        del self._heard[origin]
        mine = self._by_origin.pop(origin, {})
        for slot in list(mine):
            self._put(mine, slot, None, changed)

    def total(self, pool: str, worker: WorkerId) -> PeerLoad | None:
        """The peers' summed load on `worker` of `pool` (None: none)."""
        slot = (pool, worker)
        found = self._sums.get(slot)
        if found is None:
            return None
        since: float | None = None
        if found[1] > 0:
            # The latest restart among the origins with prefill pending there (see `PeerLoad`).
            for mine in self._by_origin.values():
                load = mine.get(slot)
                if load is None or load.prefill_tokens <= 0:
                    continue
                if load.prefill_since_s is None:
                    since = None
                    break
                since = load.prefill_since_s if since is None else max(since, load.prefill_since_s)
        return PeerLoad(pool, worker, *found, prefill_since_s=since)

    @property
    def any(self) -> bool:
        return bool(self._sums)

    def heard_from(self, origin: str) -> bool:
        return origin in self._heard

    def peers(self) -> int:
        """Peers heard from within `ttl_s` of the last `expire`."""
        return len(self._heard)

    def check_invariants(self) -> None:
        sums: dict[_Slot, LoadCounts] = {}
        for mine in self._by_origin.values():
            assert mine, "an origin without load is kept"
            for slot, load in mine.items():
                assert not load.idle, "an idle snapshot is kept"
                sums[slot] = _add(sums.get(slot, NO_LOAD), load.counts, 1)
        assert {s: c for s, c in sums.items() if any(c)} == self._sums, "sums drifted from the snapshots"
        assert set(self._by_origin) <= set(self._heard), "load from a peer never heard"
        assert len(self._heard) <= self.MAX_PEERS, "more peers than the bound"


def _add(a: LoadCounts, b: LoadCounts, sign: int) -> LoadCounts:
    return (
        a[0] + sign * b[0],
        a[1] + sign * b[1],
        a[2] + sign * b[2],
        a[3] + sign * b[3],
        a[4] + sign * b[4],
    )


def with_peer_load(view: WorkerView, load: PeerLoad | None) -> WorkerView:
    """`view` with the peers' in-flight load added. A worker's `max_in_flight` is this gateway's own
    cap, so it is raised by the peers' requests: peers' load weighs on the score, not on the cap."""
    if load is None:
        return view
    cap = view.max_in_flight
    started = view.prefill_started_s
    if load.prefill_tokens > 0:
        # The engine works on all the gateways' prompts: progress counts from the latest restart.
        own = view.in_flight_prefill_tokens > 0
        peer = load.prefill_since_s
        started = None if peer is None or (own and started is None) else max(started or peer, peer)
    return WorkerView(
        worker_id=view.worker_id,
        healthy=view.healthy,
        in_flight_requests=view.in_flight_requests + load.requests,
        in_flight_prefill_tokens=view.in_flight_prefill_tokens + load.prefill_tokens,
        in_flight_prefill_pairs=view.in_flight_prefill_pairs + load.prefill_pairs,
        in_flight_decode_tokens=view.in_flight_decode_tokens + load.decode_tokens,
        max_in_flight=None if cap is None else cap + load.requests,
        num_requests_waiting=view.num_requests_waiting,
        num_requests_running=view.num_requests_running,
        kv_usage=view.kv_usage,
        num_gpu_blocks=view.num_gpu_blocks,
        engine_block_size=view.engine_block_size,
        loaded_adapters=view.loaded_adapters,
        warming=view.warming,
        in_flight_at_scrape=view.in_flight_at_scrape,
        decode_context_tokens=view.decode_context_tokens + load.decode_context_tokens,
        prefill_started_s=started,
        role=view.role,
    )
