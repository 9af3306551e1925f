"""A tenant's limiter shares its quotas with its peers (`quotas`): what it charged goes out once,
what peers charged is charged here, and their requests in flight count against the limit."""

from __future__ import annotations

from gateway.config import QuotaConfig
from gateway.quotas import MAX_PEERS, TenantLimiter, Usage


def test_what_a_limiter_charged_is_told_once_and_its_in_flight_when_it_changes() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=60, tpm=1000, max_concurrent=4), now_s=0.0)
    woken: list[None] = []
    lim.notify = lambda: woken.append(None)
    assert lim.unshared(full=False) is None and lim.unshared(full=True) is None  # nothing yet
    assert lim.enter(0.0) is None and lim.admit(100, 0.0) is None
    assert len(woken) == 2
    assert lim.unshared(full=False) == Usage(1, 100, 1)
    assert lim.unshared(full=False) is None  # told
    assert lim.unshared(full=True) == Usage(0, 0, 1)  # a full snapshot repeats what is in flight
    lim.reconcile(100, 80, 1.0)  # the worker counted fewer: 20 given back
    lim.release(30, 1.0)
    assert lim.unshared(full=False) == Usage(0, 10, 0)


def test_a_limiter_without_quotas_tells_nothing() -> None:
    lim = TenantLimiter(QuotaConfig(), now_s=0.0)
    assert not lim.limited
    assert lim.enter(0.0) is None
    assert lim.unshared(full=True) is None


def test_peers_charges_spend_this_gateways_buckets() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=10, tpm=1000), now_s=0.0)
    lim.peer_usage("b", Usage(9, 900, 0), 0.0)
    assert lim.enter(0.0) is None  # the tenth request of the minute
    assert lim.admit(100, 0.0) is None
    refused = lim.enter(0.0)
    assert refused is not None and refused.code == "rate_limit_exceeded"
    # What is given back comes back; a peer's lump never takes more than a minute more.
    lim.peer_usage("b", Usage(10**9, 0, 0), 0.0)
    refused = lim.enter(60.0)  # a minute's refill only brings the bucket back to zero
    assert refused is not None and 5.9 < refused.retry_after_s < 6.1


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
