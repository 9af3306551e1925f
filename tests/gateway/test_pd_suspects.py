"""Inconclusive SGLang pairs: a worker is blamed only once two working partners point at it."""

from __future__ import annotations

from gateway.config.pool import PoolConfig
from gateway.pd_suspects import WITHIN_S, InconclusivePairs
from gateway.worker import Worker
from policies.base import WorkerId

CONFIG = PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])


def _workers(*names: str) -> list[Worker]:
    return [Worker(f"http://{name}:8000", CONFIG) for name in names]


def test_a_worker_failing_with_two_working_partners_is_blamed() -> None:
    p1, p2, d1, d2 = _workers("p1", "p2", "d1", "d2")
    pairs = InconclusivePairs()
    assert pairs.note(p1, d1, 1.0) == []  # one partner proves nothing
    pairs.served(p1.worker_id, d2.worker_id, 1.5)  # p1 works with another decode worker
    assert pairs.note(p2, d1, 2.0) == []  # p2 has not shown it works since
    pairs.served(p2.worker_id, d2.worker_id, 2.5)
    assert pairs.note(p1, d1, 3.0) == [d1]  # both work since failing with d1: d1 is at fault
    assert d1.breaker.failures == 1 and p1.breaker.failures == p2.breaker.failures == 0
    assert pairs.note(p2, d1, 4.0) == [d1] and d1.breaker.failures == 2  # each round counts


def test_a_healthy_worker_paired_with_a_flapping_one_is_never_blamed() -> None:
    # Two prefill workers and one decode worker that fails now and then but serves in between:
    # each prefill worker has only the one partner, so neither is blamed; the decode worker is
    # (it did fail), and its successes reset its breaker's count.
    p1, p2, d1 = _workers("p1", "p2", "d1")
    pairs = InconclusivePairs()
    for k in range(10):
        now = float(k)
        pairs.served(p1.worker_id, d1.worker_id, now)
        pairs.served(p2.worker_id, d1.worker_id, now)
        pairs.note(p2 if k % 2 else p1, d1, now)
    assert p1.breaker.failures == p2.breaker.failures == 0 and p1.breaker.closed and p2.breaker.closed


def test_partners_that_have_not_served_lately_or_failed_long_ago_do_not_count() -> None:
    p1, p2, d1 = _workers("p1", "p2", "d1")
    pairs = InconclusivePairs()
    pairs.served(p1.worker_id, d1.worker_id, 0.0)  # p2 never served
    pairs.note(p1, d1, 1.0)
    assert pairs.note(p2, d1, 2.0) == []
    pairs.served(p2.worker_id, p2.worker_id, 3.0)
    assert pairs.note(p2, d1, WITHIN_S + 2.0) == []  # p1's failure with d1 is too old now


def test_an_open_breaker_is_left_as_it_is() -> None:
    p1, p2, d1 = _workers("p1", "p2", "d1")
    pairs = InconclusivePairs()
    pairs.note(p1, d1, 0.5)
    pairs.note(p2, d1, 0.5)
    pairs.served(p1.worker_id, p1.worker_id, 1.0)
    pairs.served(p2.worker_id, p2.worker_id, 1.0)
    for k in range(6):
        pairs.note(p1 if k % 2 else p2, d1, 2.0)
    assert not d1.breaker.closed and d1.breaker.failures == 3  # open at the threshold, no more


def test_partners_that_served_only_before_failing_do_not_clear_themselves() -> None:
    # Two prefill workers on one node break together: each had served before, so neither has
    # shown it works since; the healthy decode worker they both fail with is not blamed.
    p1, p2, d1 = _workers("p1", "p2", "d1")
    pairs = InconclusivePairs()
    pairs.served(p1.worker_id, d1.worker_id, 0.0)
    pairs.served(p2.worker_id, d1.worker_id, 0.0)
    assert pairs.note(p1, d1, 5.0) == [] and pairs.note(p2, d1, 6.0) == []
    assert d1.breaker.failures == 0


def test_what_served_is_bounded_whichever_worker_is_new() -> None:
    p1 = _workers("p1")[0]
    pairs = InconclusivePairs()
    for k in range(3 * 4096):  # a stable prefill worker, decode pods churning
        pairs.served(p1.worker_id, WorkerId(f"http://d{k}:8000"), float(k) * WITHIN_S)
    assert len(pairs._served) <= 4096 + 1
