"""Peers' holdings never decide a pool's block size: one of another block size than the pool's in this
gateway's configuration is dropped and counted, before the policy could make the pool with it."""

from __future__ import annotations

import time

from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync.codec import SyncBatch
from gateway.sync.subscriber import SyncSubscriber
from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerCalibration, PeerHolding, PeerItem
from tests.gateway.sync.signed import SECRET, encode
from tests.policies.factories import BS, req

W0, W1 = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def _subscriber() -> tuple[SyncSubscriber, Registry]:
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0, W1], block_size_tokens=BS)])
    for worker in registry.pools["p"].workers.values():
        worker.healthy = True
    return SyncSubscriber(
        "me", registry, 2.0, GatewayMetrics(), secret=SECRET, share_calibration=True
    ), registry


def _holding(ref: int, first_block: int, block_size_tokens: int) -> PeerHolding:
    r = req(f"r{ref}", range(first_block, first_block + 64), pool="p")
    return PeerHolding(ref, "p", block_size_tokens, "t", r.block_keys, WorkerId(W1), r.n_prompt_tokens, 0)


async def test_a_peer_of_another_block_size_heard_first_leaves_the_pool_to_the_local_one() -> None:
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    # Before this gateway routes anything in "p": a gateway configured with 32-token blocks, then
    # one with this gateway's 16.
    items: tuple[PeerItem, ...] = (_holding(1, 0, 2 * BS), PeerCalibration("p", 2 * BS, 4000, 1000, 50.0))
    await sub.on_message(encode(SyncBatch("other", 1, time.time(), False, items)), lambda: policy)
    await sub.on_message(
        encode(SyncBatch("peer", 1, time.time(), False, (_holding(1, 1000, BS),))), lambda: policy
    )
    # The first local request keeps what the peer of the same block size taught: its prefix is a hit.
    views = registry.pools["p"].views(time.monotonic())
    d = policy.select(req("next", range(1000, 1066), pool="p"), views, time.monotonic())
    assert d is not None and d.worker == W1 and d.reason == "hit"
    # And the 32-token chain was never recorded, under any block size.
    d = policy.select(req("other", range(0, 66), pool="p"), views, time.monotonic())
    assert d is not None and d.reason != "hit"
    assert sub.stats.block_size == 2
    counters = policy.stats().counters
    assert counters["peer_holdings_applied"] == 1 and "peer_block_size_mismatch" not in counters
    assert "peer_calibration_applied" not in counters
