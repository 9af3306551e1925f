"""Holdings of a worker not discovered yet: parked, bounded, applied once discovery adds it; and a
clock far off counted apart from a malformed batch."""

from __future__ import annotations

import logging
import time

import pytest

from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync.codec import MAX_CLOCK_SKEW_S, SyncBatch
from gateway.sync.parking import ParkedHoldings
from gateway.sync.subscriber import MAX_HOLDING_KEYS, SyncSubscriber
from policies.base import RoutingPolicy, WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerHolding, PeerOutcome
from tests.gateway.sync.signed import SECRET, encode, sealed
from tests.policies.factories import BS, req

W0, W1, NEW = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def _subscriber() -> tuple[SyncSubscriber, Registry]:
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0, W1])])
    for worker in registry.pools["p"].workers.values():
        worker.healthy = True
    return SyncSubscriber("me", registry, 2.0, GatewayMetrics(), secret=SECRET), registry


def _holding(ref: int, worker: str, n_blocks: int = 8, pool: str = "p") -> PeerHolding:
    r = req(f"r{ref}", range(ref * 1000, ref * 1000 + n_blocks * BS), pool=pool)
    return PeerHolding(ref, pool, BS, "t", r.block_keys, WorkerId(worker), r.n_prompt_tokens, 0)


def _discover(registry: Registry, *urls: str) -> None:
    """What discovery does on a change (`Fleet._apply`): replace the pool's worker set, then the
    first health check makes the new ones routable."""
    pool = registry.pools["p"]
    pool.set_urls(urls)
    for worker in pool.workers.values():
        worker.healthy = True


def _route(policy: RoutingPolicy, registry: Registry, ref: int) -> tuple[WorkerId, str]:
    r = req("next", range(ref * 1000, ref * 1000 + 8 * BS + 2), pool="p")
    d = policy.select(r, registry.pools["p"].views(time.monotonic()), time.monotonic())
    assert d is not None
    return d.worker, d.reason


async def test_a_holding_that_comes_before_its_worker_is_applied_when_the_worker_is_discovered() -> None:
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    batch = SyncBatch("peer", 1, time.time(), False, (_holding(1, NEW), _holding(2, NEW)))
    await sub.on_message(encode(batch), lambda: policy)
    assert len(sub.parked) == 2 and sub.parked_any.is_set() and sub.stats.unknown_worker == 0
    assert "peer_holdings_applied" not in policy.stats().counters
    # The second one's request is served before the worker is discovered here: the outcome waits with it.
    served = SyncBatch("peer", 2, time.time(), False, (PeerOutcome(2, True),))
    await sub.on_message(encode(served), lambda: policy)
    assert "peer_outcomes_unmatched" not in policy.stats().counters
    await sub.adopt(lambda: policy)  # nothing discovered yet: nothing moves
    assert len(sub.parked) == 2
    _discover(registry, W0, W1, NEW)
    await sub.adopt(lambda: policy)
    assert len(sub.parked) == 0 and not sub.parked_any.is_set()
    counters = policy.stats().counters
    assert counters["peer_holdings_applied"] == 2 and counters["peer_outcomes_applied"] == 1
    assert _route(policy, registry, 1) == (WorkerId(NEW), "hit")
    assert _route(policy, registry, 2) == (WorkerId(NEW), "hit")
    s = sub.parked.stats
    assert (s.parked, s.applied, s.expired, s.evicted, s.withdrawn) == (2, 2, 0, 0, 0)
    sub.parked.check_invariants()


async def test_a_parked_holding_whose_request_failed_is_withdrawn_and_an_old_one_expires() -> None:
    sub, registry = _subscriber()
    policy = CostPolicy(seed=0)
    items = (_holding(1, NEW), _holding(2, NEW), PeerOutcome(1, False))
    await sub.on_message(encode(SyncBatch("peer", 1, time.time(), False, items)), lambda: policy)
    assert len(sub.parked) == 1 and sub.parked.stats.withdrawn == 1
    sub.expire(time.monotonic() + sub.parked.ttl_s)
    assert len(sub.parked) == 0 and sub.parked.stats.expired == 1 and not sub.parked_any.is_set()
    _discover(registry, W0, W1, NEW)
    await sub.adopt(lambda: policy)
    assert "peer_holdings_applied" not in policy.stats().counters
    sub.parked.check_invariants()


async def test_holdings_of_an_unknown_pool_are_dropped_not_parked() -> None:
    sub, _ = _subscriber()
    policy = CostPolicy(seed=0)
    batch = SyncBatch("peer", 1, time.time(), False, (_holding(1, W0, pool="q"),))
    await sub.on_message(encode(batch), lambda: policy)
    assert sub.stats.unknown_worker == 1 and len(sub.parked) == 0


@pytest.mark.parametrize("senders", [1, 10_000])
async def test_ten_thousand_made_up_workers_cost_a_fixed_bound(senders: int) -> None:
    # A third party on the bus names 10,000 workers of a real pool, from one sender or from as many
    # made-up senders, with chains as long as any holding applies: what is parked stays within
    # the bounds, and nothing reaches the policy.
    sub, _ = _subscriber()
    policy = CostPolicy(seed=0)
    long_keys = _holding(0, W0, n_blocks=MAX_HOLDING_KEYS + 10).keys
    for i in range(10_000):
        keys = long_keys if i % 100 == 0 else long_keys[:64]
        fake = PeerHolding(i, "p", BS, "t", keys, WorkerId(f"http://fake-{i}:8000"), 64 * BS, 0)
        sub.apply(SyncBatch(f"evil:{i % senders}", i, time.time(), False, (fake,)), policy, time.monotonic())
        assert len(sub.parked) <= ParkedHoldings.MAX_HOLDINGS and sub.parked.keys <= ParkedHoldings.MAX_KEYS
    bound = ParkedHoldings.MAX_ORIGIN_HOLDINGS if senders == 1 else ParkedHoldings.MAX_HOLDINGS
    assert 0 < len(sub.parked) <= bound
    assert len(sub.parked.slots()) <= bound
    s = sub.parked.stats
    assert s.parked == 10_000 and s.evicted == 10_000 - len(sub.parked)
    assert sub.stats.truncated == 100 and sub.stats.items == 0
    assert "peer_holdings_applied" not in policy.stats().counters
    sub.parked.check_invariants()
    sub.expire(time.monotonic() + sub.parked.ttl_s)
    assert len(sub.parked) == 0 and sub.parked.keys == 0
    sub.parked.check_invariants()


async def test_a_clock_far_off_is_counted_apart_and_logged_once_a_minute_per_sender(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sub, _ = _subscriber()
    policy = CostPolicy(seed=0)
    caplog.set_level(logging.WARNING, logger="kvgate.sync")
    for origin in ("slow", "slow", "slow", "fast"):
        skew = -2 * MAX_CLOCK_SKEW_S if origin == "slow" else 2 * MAX_CLOCK_SKEW_S
        await sub.on_message(encode(SyncBatch(origin, 1, time.time() + skew, True)), lambda: policy)
    await sub.on_message(sealed(b"\x93garbage"), lambda: policy)
    assert (sub.stats.clock_skew, sub.stats.malformed, sub.stats.batches) == (4, 1, 0)
    warned = [r for r in caplog.records if "clock" in r.getMessage()]
    assert [getattr(r, "peer", None) for r in warned] == ["slow", "fast"]
    assert getattr(warned[0], "skew_s", 0.0) == pytest.approx(-2 * MAX_CLOCK_SKEW_S, abs=5.0)
