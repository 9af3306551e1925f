"""The publishing queue and the applying side, without a broker."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

import pytest

from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync import subscriber
from gateway.sync.codec import PUBLISH_BATCH_KEYS, SyncBatch
from gateway.sync.publisher import SyncPublisher, load_bytes
from gateway.sync.subscriber import CHUNK_KEYS, MAX_HOLDING_KEYS, SyncSubscriber
from policies.base import RouteDecision, WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerCalibration, PeerHolding, PeerItem, PeerLoad, PeerOutcome
from prompt_normalizer.types import BlockKey
from tests.gateway.sync.signed import SECRET, decode, encode, sealed
from tests.policies.factories import BS, req

W0, W1 = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def _holding(ref: int) -> PeerHolding:
    return PeerHolding(ref, "p", BS, "t", req(f"r{ref}", range(4)).block_keys, WorkerId(W0), 64, 0)


def test_a_full_queue_drops_its_oldest_item_and_counts_it() -> None:
    pub = SyncPublisher("me", SyncConfig(queue_max_items=3, batch_max_items=2))
    for ref in range(1, 6):
        pub.sink(_holding(ref), 0.0)
    assert pub.dropped == 2 and pub.queued == 3 and pub.ready.is_set()
    first = pub.next_batch([], 0.0)
    assert first is not None and [i.ref for i in first.items] == [3, 4]
    second = pub.next_batch([], 0.0)
    assert second is not None and [i.ref for i in second.items] == [5] and second.seq == first.seq + 1
    assert not pub.ready.is_set() and pub.batched_items == 3


def test_each_load_stays_within_its_bound_of_bytes() -> None:
    # Every field of a load row at its widest msgpack encoding (9-byte integers), "x" and "y" too:
    # what the loads add to a batch is at most what the publisher counts them for.
    big = 2**63
    loads = tuple(PeerLoad("p", WorkerId(f"w{i:04d}"), big, big, big, big, big) for i in range(2000))
    bare = SyncBatch("me", 1, 0.0, True, (), loads[:1])
    added = len(encode(dataclasses.replace(bare, loads=loads))) - len(encode(bare))
    assert added <= sum(load_bytes(x) for x in loads[1:])


def test_loads_go_out_when_they_change_and_whole_at_each_refresh() -> None:
    pub = SyncPublisher("me", SyncConfig(load_refresh_s=1.0))
    busy, idle = PeerLoad("p", WorkerId(W0), 2, 100, 8), PeerLoad("p", WorkerId(W1), 0, 0, 0)
    full = pub.next_batch([busy, idle], 0.0)
    assert full is not None and full.full_load and full.loads == (busy,)
    assert pub.next_batch([busy, idle], 0.1) is None  # nothing changed, no item, no refresh due
    moved = PeerLoad("p", WorkerId(W1), 1, 10, 1)
    delta = pub.next_batch([idle_of(busy), moved], 0.2)
    assert delta is not None and not delta.full_load
    assert set(delta.loads) == {idle_of(busy), moved}  # the worker that went idle is said to be
    gone = pub.next_batch([], 0.3)  # W1 left the registry
    assert gone is not None and gone.loads == (PeerLoad("p", WorkerId(W1), 0, 0, 0),)
    refresh = pub.next_batch([moved], 1.05)
    assert refresh is not None and refresh.full_load and refresh.loads == (moved,)
    # A request reaching its first token moves only the decode context: that is a change too.
    decoding = PeerLoad("p", WorkerId(W1), 1, 0, 1, 10)
    batch = pub.next_batch([decoding], 1.1)
    assert batch is not None and batch.loads == (decoding,)
    # So is a pending prompt replaced by one of the same size with another predicted match.
    queued = PeerLoad("p", WorkerId(W1), 1, 500, 1, 10, 125_000)
    assert pub.next_batch([queued], 1.2) is not None
    rematched = dataclasses.replace(queued, prefill_pairs=60_000)
    batch = pub.next_batch([rematched], 1.3)
    assert batch is not None and batch.loads == (rematched,)


def idle_of(load: PeerLoad) -> PeerLoad:
    return PeerLoad(load.pool, load.worker, 0, 0, 0)


class _StoppedClocks:
    """The subscriber's `time` module, stopped: a batch's age is what the test sent, not that plus
    however long this process was preempted between sending the batch and receiving it."""

    def __init__(self) -> None:
        self.wall_s = time.time()
        self.monotonic_s = time.monotonic()

    def time(self) -> float:
        return self.wall_s

    def monotonic(self) -> float:
        return self.monotonic_s


def _stop_clocks(monkeypatch: pytest.MonkeyPatch) -> _StoppedClocks:
    clocks = _StoppedClocks()
    monkeypatch.setattr(subscriber, "time", clocks)
    return clocks


def _subscriber() -> tuple[SyncSubscriber, Registry]:
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0, W1])])
    for worker in registry.pools["p"].workers.values():
        worker.healthy = True
    return SyncSubscriber("me", registry, 2.0, GatewayMetrics(), secret=SECRET), registry


async def test_a_peer_batch_reaches_the_policy_and_the_registry_views() -> None:
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    r = req("r", range(256), pool="p")
    holding = PeerHolding(1, "p", BS, "t", r.block_keys, WorkerId(W1), r.n_prompt_tokens, 0)
    load = PeerLoad("p", WorkerId(W1), 3, 500, 20, 4096)
    batch = SyncBatch("peer", 1, time.time(), True, (holding, PeerOutcome(1, True)), (load,))
    await sub.on_message(encode(batch), lambda: policy)
    pool = registry.pools["p"]
    view = pool.workers[WorkerId(W1)].view(10.0)
    assert (view.in_flight_requests, view.in_flight_prefill_tokens, view.in_flight_decode_tokens) == (
        3,
        500,
        20,
    )
    assert view.decode_context_tokens == 4096
    assert pool.workers[WorkerId(W0)].view(10.0).in_flight_requests == 0
    d = policy.select(req("r2", range(258), pool="p"), [pool.workers[WorkerId(W0)].view(10.0), view], 10.0)
    assert d is not None and d.worker == W1 and d.reason == "hit"
    assert sub.stats.batches == 1 and sub.stats.items == 2 and sub.loads.peers() == 1
    # The peer goes silent: its load is forgotten, the view returns to this gateway's own.
    sub.expire(1e12)
    assert pool.workers[WorkerId(W1)].view(10.0).in_flight_requests == 0 and sub.loads.peers() == 0


async def test_own_batches_bad_bytes_and_gaps() -> None:
    sub, _ = _subscriber()
    policy = CostPolicy(seed=0)
    await sub.on_message(encode(SyncBatch("me", 1, time.time(), True, (_holding(1),))), lambda: policy)
    assert sub.stats.batches == 0 and "peer_holdings_applied" not in policy.stats().counters
    await sub.on_message(b"\x93garbage", lambda: policy)  # not sealed: dropped unread
    await sub.on_message(sealed(b"\x93garbage"), lambda: policy)
    await sub.on_message(sealed({"o": "peer"}), lambda: policy)
    assert sub.stats.bad_signature == 1 and sub.stats.malformed == 2
    for seq in (1, 2, 6, 5, 6):
        await sub.on_message(encode(SyncBatch("peer", seq, time.time(), False)), lambda: policy)
    # 3 to 5 were lost; 5, come after 6, and 6 again are dropped (`tests/gateway/sync/test_replays.py`).
    assert sub.sequences.lost == 3 and sub.sequences.replayed == 2 and sub.stats.batches == 3


def test_a_policy_publishes_through_the_publisher_sink() -> None:
    pub = SyncPublisher("me", SyncConfig())
    policy = CostPolicy(seed=0)
    policy.set_sync_sink(pub.sink)
    r = req("r", range(8), pool="p")
    policy.on_dispatch(r, RouteDecision(WorkerId(W0), 0.0, "miss"), 0.0)
    batch = pub.next_batch([], 0.0)
    assert batch is not None and isinstance(batch.items[0], PeerHolding)
    assert batch.items[0].keys == r.block_keys and batch.origin == "me"


async def test_a_large_batch_is_applied_in_chunks_with_the_loop_free_in_between() -> None:
    sub, _ = _subscriber()
    policy = CostPolicy(seed=0)
    holdings = tuple(_holding(ref) for ref in range(1, 100))
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    before = ticks
    await sub.on_message(encode(SyncBatch("peer", 1, time.time(), False, holdings)), lambda: policy)
    task.cancel()
    assert sub.stats.items == 99 and policy.stats().counters["peer_holdings_applied"] == 99
    assert ticks - before >= 3  # 99 items in chunks of 32: the other task ran between them


def _long_holding(ref: int, blocks: int) -> PeerHolding:
    keys = req(f"long{ref}", range(blocks)).block_keys
    return PeerHolding(ref, "p", BS, "tenant:team-a", keys, WorkerId(W0), blocks * BS, 0)


def test_batches_are_cut_to_the_brokers_largest_message_and_an_item_too_large_for_any_is_counted() -> None:
    limit = 16 * 1024
    pub = SyncPublisher("me", SyncConfig(batch_max_items=1000))
    for ref in range(1, 9):
        pub.sink(_long_holding(ref, 700), 0.0)  # ~5.6 KB of keys each: two fit in one batch, not three
    pub.sink(_long_holding(9, 3000), 0.0)  # 24 KB of keys: no batch can carry it
    pub.sink(_holding(10), 0.0)
    busy = PeerLoad("p", WorkerId(W1), 3, 300, 9)
    batches = []
    while (batch := pub.next_batch([busy], 0.0, limit)) is not None:
        batches.append(batch)
        if not pub.queued:
            break
    assert all(len(encode(b)) <= limit for b in batches)
    assert [i.ref for b in batches for i in b.items] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert len(batches) >= 4 and batches[0].loads == (busy,)
    assert pub.oversized == 1 and pub.batched_items == 9


async def test_calibration_samples_are_applied_only_with_share_calibration() -> None:
    sample = PeerCalibration("p", BS, 4000, 1000, 2.0)
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0])])
    batch = encode(SyncBatch("peer", 1, time.time(), False, (sample,)))
    for share, applied in ((True, 1), (False, 0)):
        policy = CostPolicy(seed=0)
        sub = SyncSubscriber("me", registry, 2.0, GatewayMetrics(), secret=SECRET, share_calibration=share)
        await sub.on_message(batch, lambda policy=policy: policy)
        assert policy.stats().counters.get("peer_calibration_applied", 0) == applied


def test_the_publisher_knows_while_peers_count_prefill_tokens_of_its_own() -> None:
    pub = SyncPublisher("me", SyncConfig())
    assert not pub.prefill_published
    assert pub.next_batch([PeerLoad("p", WorkerId(W0), 1, 500, 10)], 0.0) is not None
    assert pub.prefill_published
    # The prefill ended: that load changed, so it goes out with no item to carry it.
    batch = pub.next_batch([PeerLoad("p", WorkerId(W0), 1, 0, 10)], 0.01)
    assert batch is not None and batch.items == () and batch.loads == (PeerLoad("p", WorkerId(W0), 1, 0, 10),)
    assert not pub.prefill_published
    assert pub.next_batch([PeerLoad("p", WorkerId(W0), 1, 0, 10)], 0.02) is None


async def test_a_peer_holding_counts_against_the_decisions_made_since_the_peer_sent_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks = _stop_clocks(monkeypatch)
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0, W1])])
    sub = SyncSubscriber("me", registry, 2.0, GatewayMetrics(), secret=SECRET)
    policy = CostPolicy(seed=0)
    policy.set_sync_sink(lambda item, now_s: None, origin="me")
    skew_s = 10.0  # the peer's wall clock is 10 s behind ours
    # A batch sent just now: the smallest age seen from this peer, its clocks' skew.
    await sub.on_message(encode(SyncBatch("peer", 1, clocks.wall_s - skew_s, True)), lambda: policy)
    now = clocks.monotonic_s
    for k, ago_s in enumerate((1.0, 0.001)):  # two decisions here, 1 s and 1 ms ago
        r = req(f"own{k}", range(100 * k, 100 * k + 8), pool="p")
        policy.on_dispatch(r, RouteDecision(WorkerId(W0), 0.0, "miss"), now - ago_s)
    # The peer sent this batch 50 ms ago: its holding was decided then at the latest, not 10 s ago
    # as the clocks alone would say.
    batch = SyncBatch("peer", 2, clocks.wall_s - skew_s - 0.05, True, (_holding(1),))
    assert sub.decided_s(batch, now) == pytest.approx(now - 0.05, abs=1e-6)
    await sub.on_message(encode(batch), lambda: policy)
    # The decision of 1 ms ago could not see it, the one of 1 s ago was before it.
    assert policy._unseen.per_decision == pytest.approx(0.5, rel=0.05)  # the older one decayed a little
    assert "peer" in policy._gateways.names(now)


def test_a_batch_says_how_long_its_first_item_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("gateway.sync.publisher.time.monotonic", lambda: clock[0])
    pub = SyncPublisher("me", SyncConfig())
    pub.sink(_holding(1), 0.0)
    clock[0] += 0.003
    pub.sink(_holding(2), 0.0)
    clock[0] += 0.002
    batch = pub.next_batch([], 0.0)
    assert batch is not None and len(batch.items) == 2 and batch.waited_s == pytest.approx(0.005)
    batch = pub.next_batch([PeerLoad("p", WorkerId(W0), 1, 0, 10)], 0.0)
    assert batch is not None and batch.items == () and batch.waited_s == 0.0  # loads only


def test_a_peer_item_that_waited_in_its_batch_counts_from_when_it_came(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks = _stop_clocks(monkeypatch)
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0, W1])])
    sub = SyncSubscriber("me", registry, 2.0, GatewayMetrics(), secret=SECRET)
    now, sent_s = clocks.monotonic_s, clocks.wall_s
    sub.decided_s(SyncBatch("peer", 1, sent_s, True), now)  # the smallest age
    fresh = sub.decided_s(SyncBatch("peer", 2, sent_s, True), now)
    waited = sub.decided_s(SyncBatch("peer", 3, sent_s, True, (_holding(1),), (), 0.5), now)
    assert fresh == now and fresh - waited == pytest.approx(0.5, abs=1e-6)


async def test_holdings_and_loads_of_workers_this_gateway_does_not_have_leave_nothing_and_are_counted() -> (
    None
):
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    made_up = WorkerId("w-made-up")
    r = req("r", range(64), pool="p")
    items = (
        PeerHolding(1, "p", BS, "t", r.block_keys, made_up, r.n_prompt_tokens, 0),  # pool known, worker not
        PeerHolding(2, "q", BS, "t", r.block_keys, WorkerId(W0), r.n_prompt_tokens, 0),  # pool unknown
        PeerCalibration("q", BS, 4000, 1000, 2.0),
    )
    fakes = tuple(PeerLoad("p", WorkerId(f"w{i}"), 1, 1, 1) for i in range(500))
    real = PeerLoad("p", WorkerId(W1), 2, 100, 8)
    batch = SyncBatch(
        "peer", 1, time.time(), False, items, (*fakes, PeerLoad("q", WorkerId(W0), 1, 1, 1), real)
    )
    sub.share_calibration = True
    await sub.on_message(encode(batch), lambda: policy)
    # The holding of a worker of a known pool waits for discovery (`ParkedHoldings`); the rest is dropped.
    assert sub.stats.unknown_worker == 2 + 501 and sub.stats.items == 0
    assert len(sub.parked) == 1 and sub.parked.slots() == [("p", made_up)]
    counters = policy.stats().counters
    assert "peer_holdings_applied" not in counters and "peer_calibration_applied" not in counters
    assert policy._pools.existing("q") is None and policy._peers.pending() == (0, 0)
    assert sub.loads.total("p", made_up) is None and sub.loads.total("p", WorkerId("w7")) is None
    assert sub.loads.total("p", WorkerId(W1)) == real  # what is known still applies
    assert registry.pools["p"].workers[WorkerId(W1)].view(10.0).in_flight_requests == 2
    sub.loads.check_invariants()


async def test_a_long_holding_is_cut_and_a_batch_is_applied_in_steps_bounded_by_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sub, _ = _subscriber()
    policy = CostPolicy(seed=0)
    steps: list[int] = []
    apply_items = sub.apply_items

    def counted(origin: str, items: Sequence[PeerItem], *args: object, **kw: float | None) -> None:
        steps.append(sum(len(x.keys) for x in items if isinstance(x, PeerHolding)))
        apply_items(origin, items, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sub, "apply_items", counted)
    long = _long_holding(1, MAX_HOLDING_KEYS + 5000)
    medium = tuple(_long_holding(ref, 1500) for ref in range(2, 12))  # 15,000 keys in all
    await sub.on_message(encode(SyncBatch("peer", 1, time.time(), False, (long, *medium))), lambda: policy)
    assert steps[0] == MAX_HOLDING_KEYS and all(n <= CHUNK_KEYS for n in steps[1:])
    assert sum(steps) == MAX_HOLDING_KEYS + 15_000 and len(steps) >= 1 + 15_000 // CHUNK_KEYS
    assert sub.stats.truncated == 1 and policy.stats().counters["peer_holdings_applied"] == 11
    # The cut holding is what its outcome settles.
    await sub.on_message(
        encode(SyncBatch("peer", 2, time.time(), False, (PeerOutcome(1, True),))), lambda: policy
    )
    assert policy.stats().counters["peer_outcomes_applied"] == 1


def test_a_batch_never_carries_more_keys_than_peers_accept() -> None:
    pub = SyncPublisher("me", SyncConfig(batch_max_items=1000))
    per_holding = PUBLISH_BATCH_KEYS // 3 + 1  # three do not fit in one batch
    keys = tuple(BlockKey(k) for k in range(per_holding))
    for ref in range(1, 4):
        pub.sink(PeerHolding(ref, "p", BS, "t", keys, WorkerId(W0), 16 * per_holding, 0), 0.0)
    batches = [pub.next_batch([], 0.0, 64 << 20) for _ in range(2)]
    assert [[i.keys[-1] for i in b.items if isinstance(i, PeerHolding)] for b in batches if b] == [
        [keys[-1]] * 2,
        [keys[-1]],
    ]
    assert [len(b.items) for b in batches if b] == [2, 1]
    assert all(len(decode(encode(b)).items) for b in batches if b)
