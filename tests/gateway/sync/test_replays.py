"""A peer's batch applies once and never after a newer one of its sender: copies, replays and
overtaken batches are dropped and counted (`gateway.sync.sequence`)."""

from __future__ import annotations

import time

from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync.codec import SyncBatch
from gateway.sync.sequence import SenderSequences
from gateway.sync.subscriber import SyncSubscriber
from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerHolding, PeerLoad, PeerOutcome
from tests.gateway.sync.signed import SECRET, encode
from tests.policies.factories import BS, req

W0, W1 = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def _subscriber() -> tuple[SyncSubscriber, Registry]:
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0, W1])])
    for worker in registry.pools["p"].workers.values():
        worker.healthy = True
    return SyncSubscriber("me", registry, 2.0, GatewayMetrics(), secret=SECRET), registry


def _snapshot(seq: int, requests: int) -> bytes:
    """The peer's whole load: `requests` on W1, W0 idle."""
    loads = (PeerLoad("p", WorkerId(W0), 0, 0, 0), PeerLoad("p", WorkerId(W1), requests, 100 * requests, 8))
    return encode(SyncBatch("peer", seq, time.time(), True, (), loads))


async def test_a_copy_or_an_older_batch_never_sets_a_peers_load_back() -> None:
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    w1 = registry.pools["p"].workers[WorkerId(W1)]
    older, newer = _snapshot(1, 1), _snapshot(2, 5)
    await sub.on_message(older, lambda: policy)
    await sub.on_message(newer, lambda: policy)
    assert w1.view(time.monotonic()).in_flight_requests == 5
    for again in (older, newer, older):  # a replay, a redelivery, a replay
        await sub.on_message(again, lambda: policy)
        assert w1.view(time.monotonic()).in_flight_requests == 5
    assert sub.sequences.replayed == 3 and sub.sequences.lost == 0 and sub.stats.batches == 2
    # The next batch of the peer applies as usual.
    await sub.on_message(_snapshot(3, 2), lambda: policy)
    assert w1.view(time.monotonic()).in_flight_requests == 2 and sub.stats.batches == 3


async def test_a_holding_its_failure_took_back_is_not_recorded_again_by_a_copy() -> None:
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    r = req("r", range(64), pool="p")
    holding = PeerHolding(1, "p", BS, "t", r.block_keys, WorkerId(W1), r.n_prompt_tokens, 0)
    dispatched = encode(SyncBatch("peer", 1, time.time(), False, (holding,)))
    failed = encode(SyncBatch("peer", 2, time.time(), False, (PeerOutcome(1, False),)))
    for data in (dispatched, failed, dispatched):
        await sub.on_message(data, lambda: policy)
    views = registry.pools["p"].views(time.monotonic())
    d = policy.select(req("r2", range(66), pool="p"), views, time.monotonic())
    assert d is not None and d.reason != "hit"  # W1 never computed the prefix
    counters = policy.stats().counters
    assert counters["peer_holdings_applied"] == 1 and counters["peer_outcomes_applied"] == 1
    assert sub.sequences.replayed == 1


def test_a_senders_number_outlives_its_peer_timeout_and_is_forgotten_after_twice_the_clock_skew() -> None:
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    w1 = registry.pools["p"].workers[WorkerId(W1)]
    t0 = time.monotonic()
    load = (PeerLoad("p", WorkerId(W1), 3, 10, 1),)
    last = SyncBatch("peer", 7, time.time(), True, (), load)
    sub.apply(last, policy, t0)
    sub.expire(t0 + 60.0)  # silent for longer than its peer timeout: forgotten with its load
    assert sub.loads.peers() == 0 and w1.view(t0).in_flight_requests == 0
    sub.apply(last, policy, t0 + 60.0)  # its last batch, replayed while its send time is still accepted
    assert sub.loads.peers() == 0 and w1.view(t0).in_flight_requests == 0
    assert sub.sequences.replayed == 1
    later = t0 + SenderSequences.MEMORY_S + 0.001  # past it whatever t0's float rounding does
    sub.expire(later)
    assert len(sub.sequences) == 0  # by now the codec refuses any copy for its send time


def test_the_senders_remembered_are_bounded_the_least_recently_heard_forgotten_first() -> None:
    seqs = SenderSequences()
    assert seqs.admit("real", 5, 0.0)
    for i in range(SenderSequences.MAX_SENDERS - 1):
        assert seqs.admit(f"made-up:{i}", 1, 1.0)
    assert not seqs.admit("real", 5, 2.0) and seqs.admit("real", 6, 2.0)  # still known, heard again
    assert seqs.admit("one-more", 1, 3.0)
    assert len(seqs) == SenderSequences.MAX_SENDERS
    assert seqs.admit("made-up:0", 1, 4.0)  # the least recently heard was forgotten
    assert not seqs.admit("real", 6, 5.0)
    assert seqs.replayed == 2 and seqs.lost == 0
    seqs.check_invariants()


def test_a_made_up_jump_in_a_senders_numbers_counts_a_bounded_loss() -> None:
    # A batch numbered 2^62 by someone holding the broker's token is no loss of 2^62 batches: each
    # gap counts at most MAX_COUNTED_GAP, so `lost_batches` stays a count of traffic.
    seqs = SenderSequences()
    assert seqs.admit("peer", 1, 0.0) and seqs.admit("peer", 3, 0.1)
    assert seqs.lost == 1
    assert seqs.admit("peer", 2**62, 0.2)
    assert seqs.lost == 1 + SenderSequences.MAX_COUNTED_GAP
