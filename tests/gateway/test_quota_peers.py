"""A tenant's limiter shares its quotas with its peers (`quotas`): what it charged goes out once,
what peers charged is charged here, and their requests in flight count against the limit."""

from __future__ import annotations

from gateway.config import QuotaConfig
from gateway.quotas import MAX_PEERS, TenantLimiter, Usage
from gateway.rate_buckets import TokenBucket, late_weight


def test_what_a_limiter_charged_is_told_once_and_its_in_flight_when_it_changes() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=60, tpm=1000, max_concurrent=4), now_s=0.0)
    woken: list[None] = []
    lim.notify = lambda: woken.append(None)
    assert lim.unshared(False, 0.0) is None and lim.unshared(True, 0.0) is None  # nothing yet
    assert lim.enter(0.0) is None and lim.admit(100, 0.0) is None
    assert len(woken) == 2
    assert lim.unshared(False, 0.0) == Usage(1, 100, 1)
    assert lim.unshared(False, 0.0) is None  # told
    assert lim.unshared(True, 0.0) == Usage(0, 0, 1)  # a full snapshot repeats what is in flight
    lim.reconcile(100, 80, 1.0)  # the worker counted fewer: 20 given back
    lim.release(30, 1.0)
    assert lim.unshared(False, 0.0) == Usage(0, 10, 0)


def test_a_limiter_without_quotas_tells_nothing() -> None:
    lim = TenantLimiter(QuotaConfig(), now_s=0.0)
    assert not lim.limited
    assert lim.enter(0.0) is None
    assert lim.unshared(True, 0.0) is None


def test_peers_charges_spend_this_gateways_buckets() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=10, tpm=1000), now_s=0.0)
    lim.peer_usage("b", Usage(9, 900, 0), 0.0)
    assert lim.enter(0.0) is None  # the tenth request of the minute
    assert lim.admit(100, 0.0) is None
    refused = lim.enter(0.0)
    assert refused is not None and refused.code == "rate_limit_exceeded"
    # A peer's lump (late, or made up) costs two minutes of budget at most.
    lim.peer_usage("b", Usage(10**9, 0, 0), 6.0)
    refused = lim.enter(6.0)
    # At most the capacity at once: from 1 (the refill since 0 s) to -9; 10 to refill for the next.
    assert refused is not None and 59.9 < refused.retry_after_s < 60.1
    assert lim.enter(66.0) is None


def test_peers_requests_in_flight_count_against_the_limit_until_the_peer_falls_silent() -> None:
    lim = TenantLimiter(QuotaConfig(max_concurrent=3), now_s=0.0)
    lim.peer_usage("b", Usage(0, 0, 2), 0.0)
    lim.peer_usage("c", Usage(0, 0, 1), 1.0)
    assert lim.peers_in_flight == 3
    assert lim.enter(1.0) is not None
    lim.peer_usage("b", Usage(0, 0, 1), 2.0)  # b says it has one now, not two more
    assert lim.peers_in_flight == 2 and lim.enter(2.0) is None
    lim.forget_peers(silent_since_s=1.5)  # c said nothing since 1.0
    assert lim.peers_in_flight == 1
    lim.peer_usage("b", Usage(0, 0, 0), 3.0)
    assert lim.peers_in_flight == 0


def test_made_up_peers_beyond_the_bound_count_nothing() -> None:
    lim = TenantLimiter(QuotaConfig(max_concurrent=10**6), now_s=0.0)
    for k in range(MAX_PEERS + 50):
        lim.peer_usage(f"p{k}", Usage(0, 0, 1), 0.0)
    assert lim.peers_in_flight == MAX_PEERS
    lim.forget_peers(silent_since_s=1.0)
    assert lim.peers_in_flight == 0


def test_a_peers_charge_never_gives_budget_back() -> None:
    lim = TenantLimiter(QuotaConfig(tpm=1000), now_s=0.0)
    assert lim.enter(0.0) is None and lim.admit(10, 0.0) is None
    lim.release(5000, 0.0)  # a long completion: this gateway's own debt, far below empty
    refused = lim.admit(1, 0.0)
    assert refused is not None
    lim.peer_usage("b", Usage(0, 100, 0), 0.0)
    again = lim.admit(1, 0.0)
    assert again is not None and again.retry_after_s >= refused.retry_after_s


def test_tokens_given_back_stay_with_the_gateway_that_charged_them() -> None:
    lim = TenantLimiter(QuotaConfig(tpm=1000), now_s=0.0)
    assert lim.enter(0.0) is None and lim.admit(500, 0.0) is None
    assert lim.unshared(False, 0.0) == Usage(0, 500, 1)
    lim.reconcile(500, 100, 1.0)  # the worker counted 400 fewer
    lim.release(0, 1.0)
    assert lim.unshared(False, 1.0) == Usage(0, 0, 0)  # nothing negative goes out
    assert lim.enter(2.0) is None and lim.admit(300, 2.0) is None
    assert lim.unshared(False, 2.0) == Usage(0, 0, 1)  # the 400 given back offset them
    # A peer's negative figure (only a forged row has one) refills nothing.
    spent = TenantLimiter(QuotaConfig(tpm=1000), now_s=0.0)
    assert spent.enter(0.0) is None and spent.admit(1000, 0.0) is None
    spent.peer_usage("forged", Usage(0, -(1 << 40), 0), 0.0)
    assert spent.admit(10, 0.0) is not None


def test_charges_kept_through_a_broker_outage_are_forgiven_as_the_bucket_refilled() -> None:
    # A, cut off for ten minutes, admits the tenant at half its rpm: a shared bucket would have
    # refilled all of it, so B must not be emptied by the lump when the broker is back.
    a = TenantLimiter(QuotaConfig(rpm=60), now_s=0.0)
    b = TenantLimiter(QuotaConfig(rpm=60), now_s=0.0)
    t = 0.0
    while t < 600.0:
        assert a.enter(t) is None
        a.release(0, t)
        t += 2.0
    lump = a.unshared(False, 600.0)
    assert lump is None or lump.requests <= 1
    if lump is not None:
        b.peer_usage("a", lump, 600.0)
    assert b.enter(600.0) is None
    # Charges told within the gap are told whole.
    assert a.enter(600.5) is None and a.enter(600.6) is None
    told = a.unshared(False, 601.0)
    assert told is not None and told.requests == 2


def test_a_peer_counts_at_most_the_limit_in_flight() -> None:
    lim = TenantLimiter(QuotaConfig(max_concurrent=4), now_s=0.0)
    lim.peer_usage("made-up", Usage(0, 0, 1 << 32), 0.0)
    assert lim.peers_in_flight == 4


def test_what_was_not_published_is_told_again() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=60, max_concurrent=4), now_s=0.0)
    assert lim.enter(0.0) is None
    lost = lim.unshared(False, 0.0)
    assert lost == Usage(1, 0, 1)
    lim.unsend(lost, 0.0)
    assert lim.unshared(False, 0.1) == Usage(1, 0, 1)


def test_charges_made_after_the_wait_drained_are_told_whole() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=60), now_s=0.0)
    assert lim.enter(0.0) is None  # then the broker is away for ten minutes
    lim.release(0, 0.0)
    for _ in range(59):
        assert lim.enter(599.0) is None
        lim.release(0, 599.0)
    told = lim.unshared(False, 600.0)
    # The first drained away long ago; of the 59, one second's refill (1) beyond the gap.
    assert told is not None and told.requests == 58


def test_saturated_gateways_sharing_admit_the_quota_not_twice_it() -> None:
    # Two gateways with more demand than the quota, telling each other every 5 ms.
    lims = [TenantLimiter(QuotaConfig(rpm=600), now_s=0.0) for _ in range(2)]
    admitted, t = 0, 0.0
    while t < 600.0:
        for lim in lims:
            if lim.enter(t) is None:
                lim.release(0, t)
                admitted += t >= 300.0
        rows = [lim.unshared(False, t) for lim in lims]
        for i, row in enumerate(rows):
            if row is not None:
                lims[1 - i].peer_usage(f"g{i}", row, t)
        t += 0.005
    assert 2900 <= admitted <= 3100  # 600 a minute over the last five minutes


def test_a_peers_late_charge_counts_less_the_later_it_comes() -> None:
    assert [late_weight(s) for s in (-1.0, 0.0, 15.0, 30.0, 60.0, 600.0)] == [1.0, 1.0, 0.75, 0.5, 0.0, 0.0]
    lim = TenantLimiter(QuotaConfig(rpm=60, tpm=1000, max_concurrent=4), now_s=0.0)
    lim.peer_usage("b", Usage(10, 100, 0), 100.0)  # on time: whole (and the buckets are not full)
    lim.peer_usage("b", Usage(20, 400, 2), 100.0, late_s=30.0)  # half of it
    assert lim.remaining(100.0) == {"requests": 40.0, "tokens": 700.0, "concurrent": 2}
    lim.forget_peers(silent_since_s=69.0)  # its requests in flight were said at 70 s, received at 100 s
    assert lim.peers_in_flight == 2
    lim.forget_peers(silent_since_s=71.0)
    assert lim.peers_in_flight == 0
    lim.peer_usage("b", Usage(60, 1000, 0), 100.0, late_s=60.0)  # a bucket's window late: nothing
    assert lim.remaining(100.0) == {"requests": 40.0, "tokens": 700.0, "concurrent": 4}


def test_a_late_charge_to_a_bucket_full_since_counts_what_on_time_would_have_left() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=60), now_s=0.0)  # full since ever; refills 1 a second
    # Told 10 s ago: on time it would have been refilled by 10 since, 20 left (its weight: 25).
    lim.peer_usage("b", Usage(30, 0, 0), 100.0, late_s=10.0)
    assert lim.remaining(100.0)["requests"] == 40.0
    lim.peer_usage("b", Usage(12, 0, 0), 100.0, late_s=10.0)  # not full now: its weight, 10
    assert lim.remaining(100.0)["requests"] == 30.0
    # Full again at 130 s: a charge told at 125 s would have been refilled by 10 since, 2 left.
    lim.peer_usage("b", Usage(12, 0, 0), 140.0, late_s=15.0)
    assert lim.remaining(140.0)["requests"] == 58.0


def test_a_stream_of_small_late_charges_to_a_full_bucket_spends_it_as_on_time() -> None:
    # Rows of 1 request every 0.5 s, each told 3 s before it arrives, to `rpm: 60` (1 a second):
    # on time, the bucket would have been charged 2 a second and refilled 1, from full.
    lim = TenantLimiter(QuotaConfig(rpm=60), now_s=0.0)
    for k in range(120):
        lim.peer_usage("b", Usage(1, 0, 0), 100.0 + 0.5 * k, late_s=3.0)
    on_time = 60.0 - (120 - (0.5 * 119 + 3.0))  # 2.5: refilled 62.5 of the 120
    assert on_time < lim.remaining(159.5)["requests"] < on_time + 0.05 * 120  # each weighs 95 %


def test_a_bucket_knows_since_when_it_is_full() -> None:
    bucket = TokenBucket(60, now_s=0.0)
    bucket.check_invariants()
    for amount, now_s in ((10.0, 1.0), (-5.0, 2.0), (-100.0, 3.0), (1.0, 3.5), (0.0, 10.0)):
        bucket.take(amount, now_s)
        bucket.check_invariants()
    bucket.take_from_peer(200.0, 11.0)
    bucket.level(12.0)
    bucket.check_invariants()
    assert bucket.level(200.0) == 60.0
    bucket.check_invariants()
