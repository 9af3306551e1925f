"""A peer's quota rows count no more than they would have on time (`rate_buckets.late_weight`,
`TokenBucket.take_late`, `batch_age.late_s`): a gateway that just started, handed the captured
batches of a peer's last ten minutes one after another (each newer than the last, so each
applies), charges what on time would still be left of them, and a batch a slow broker delivered
late charges the share of it its buckets' window has not refilled; requests in flight said too
long ago are not counted."""

from __future__ import annotations

import time

from gateway.config import QuotaConfig
from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.quotas import TenantLimiter, Usage
from gateway.rate_buckets import BUCKET_WINDOW_S
from gateway.registry import Registry
from gateway.sync.batch_age import ON_TIME_S
from gateway.sync.codec import SyncBatch
from gateway.sync.subscriber import SyncSubscriber
from policies.cost_policy import CostPolicy
from tests.gateway.sync.signed import SECRET, decode, encode

PEER_TIMEOUT_S = 5.0


def _gateway(quotas: QuotaConfig, now_s: float) -> tuple[SyncSubscriber, TenantLimiter]:
    """A gateway that has just started: it has heard of no sender yet."""
    registry = Registry([PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])])
    limiter = TenantLimiter(quotas, now_s=now_s)
    sub = SyncSubscriber(
        "me", registry, PEER_TIMEOUT_S, GatewayMetrics(), secret=SECRET, limiters={"t": limiter}
    )
    return sub, limiter


def _weight(age_s: float) -> float:
    return max(0.0, min(1.0, 1.0 - (age_s - ON_TIME_S) / BUCKET_WINDOW_S))


def _charged(ages: list[float]) -> float:
    """What 5 requests of each of batches of these ages weigh, to a bucket that is not full."""
    return sum(5.0 * _weight(age) for age in ages)


def _captured(wall: float) -> tuple[list[float], list[bytes]]:
    """A peer's genuine batches, one every 10 s for 590 s, each 5 requests of a tenant with 3 in
    flight: 30 rpm of the tenant's 100, captured off the bus; their ages at wall clock `wall`,
    and their bytes."""
    ages = [590.0 - 10.0 * k for k in range(59)]
    captured = [
        encode(SyncBatch("peer", k + 1, wall - age, False, usage=(("t", Usage(5, 0, 3)),)))
        for k, age in enumerate(ages)
    ]
    return ages, captured


async def test_ten_minutes_of_captured_batches_leave_a_started_gateways_full_bucket_full() -> None:
    ages, captured = _captured(time.time())
    sub, limiter = _gateway(QuotaConfig(rpm=100, max_concurrent=3), time.monotonic())
    policy = CostPolicy(seed=0)
    for data in captured:  # published again, oldest first
        await sub.on_message(data, lambda: policy)
    assert sub.stats.batches == 59 and sub.sequences.replayed == 0  # each applied, in turn
    now_s = time.monotonic()
    # On time, each charge would have been refilled before the next (30 rpm of 100): the bucket,
    # full since this gateway started, stays full (ten minutes of charges at once took it to -100).
    assert limiter.remaining(now_s)["requests"] == 100.0
    # The requests in flight the last batch said, 10 s ago, are not counted: the tenant is served.
    assert limiter.peers_in_flight == 0
    assert limiter.enter(now_s) is None
    stale = sum(1 for age in ages if _weight(age) == 0.0)
    assert (sub.stats.stale_quota, sub.stats.late_quota) == (stale, 59 - stale) == (53, 6)


def test_captured_batches_handed_to_a_gateway_whose_bucket_is_spent_charge_their_weight() -> None:
    wall = time.time()
    ages, captured = _captured(wall)
    t0 = time.monotonic()
    sub, limiter = _gateway(QuotaConfig(rpm=100), t0)
    assert limiter.enter(t0) is None  # the tenant's own request here: the bucket is not full
    policy = CostPolicy(seed=0)
    for data in captured:
        sub.apply(decode(data), policy, t0)
    applied = time.time()
    # At most the last minute's 30 requests, each less the older it is: about 13.5, not 200
    # (each weighed when it was applied, between `wall` and `applied`).
    remaining = limiter.remaining(t0)["requests"]
    assert 99.0 - _charged(ages) <= remaining <= 99.0 - _charged([age + applied - wall for age in ages])
    assert remaining > 99.0 - 30.0


def test_a_late_batch_charges_what_its_window_has_not_refilled() -> None:
    t0 = time.monotonic()
    sub, limiter = _gateway(QuotaConfig(rpm=100, tpm=10_000), t0)
    policy = CostPolicy(seed=0)
    # On time (within ON_TIME_S of its send time): charged whole.
    sub.apply(SyncBatch("peer", 1, time.time() - 1.0, False, usage=(("t", Usage(10, 1000, 0)),)), policy, t0)
    assert limiter.remaining(t0) == {"requests": 90.0, "tokens": 9000.0}
    # 20 s after its send time (a broker that held it back): 18 s late, 70 % of it is charged
    # (a little less for each moment the test takes: bounded by the wall clock after it).
    sent = time.time() - 20.0
    sub.apply(SyncBatch("peer", 2, sent, False, usage=(("t", Usage(30, 3000, 0)),)), policy, t0)
    share = _weight(time.time() - sent)
    remaining = limiter.remaining(t0)
    assert 90.0 - 21.0 <= remaining["requests"] <= 90.0 - 30.0 * share
    assert 9000.0 - 2100.0 <= remaining["tokens"] <= 9000.0 - 3000.0 * share
    # A bucket's window late, or more: nothing.
    stale = SyncBatch("peer", 3, time.time() - 70.0, False, usage=(("t", Usage(30, 3000, 0)),))
    sub.apply(stale, policy, t0)
    assert limiter.remaining(t0) == remaining
    assert (sub.stats.late_quota, sub.stats.stale_quota) == (1, 1)


def test_a_late_batchs_requests_in_flight_count_from_when_they_were_said() -> None:
    t0 = time.monotonic()
    sub, limiter = _gateway(QuotaConfig(max_concurrent=4), t0)
    policy = CostPolicy(seed=0)
    # Said 3 s late: counted now, and forgotten a peer timeout after they were said, not received.
    sub.apply(
        SyncBatch("peer", 1, time.time() - ON_TIME_S - 3.0, False, usage=(("t", Usage(0, 0, 2)),)), policy, t0
    )
    assert limiter.peers_in_flight == 2
    sub.expire(t0 + PEER_TIMEOUT_S - 2.5)
    assert limiter.peers_in_flight == 0
    # Said longer than a peer timeout ago: not counted at all, and the sender's older figure with it.
    sub.apply(SyncBatch("peer", 2, time.time(), False, usage=(("t", Usage(0, 0, 1)),)), policy, t0 + 3.0)
    assert limiter.peers_in_flight == 1
    old = SyncBatch(
        "peer", 3, time.time() - ON_TIME_S - PEER_TIMEOUT_S - 1.0, False, usage=(("t", Usage(0, 0, 4)),)
    )
    sub.apply(old, policy, t0 + 3.0)
    assert limiter.peers_in_flight == 0
    assert limiter.enter(t0 + 3.0) is None
