"""Inconclusive SGLang pairs: a worker is blamed only once two working partners point at it."""

from __future__ import annotations

from gateway.config.pool import PoolConfig
from gateway.pd_suspects import NO_SUSPECTS, PROBES, SUSPECT_ROUNDS, WITHIN_S, InconclusivePairs, Suspects
from gateway.worker import Worker
from policies.base import WorkerId

CONFIG = PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])


class _Everyone:
    """A pool that every worker is in (of the tests whose workers never leave)."""

    def __contains__(self, worker: object) -> bool:
        return True


EVERYONE = _Everyone()


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


# -- one partner ------------------------------------------------------------------------------


def _failed_then_served(
    pairs: InconclusivePairs, failed: tuple[Worker, Worker], by: tuple[Worker, Worker], now: float
) -> list[Worker]:
    """A request whose first round, `failed`, was inconclusive and whose retry `by` served it."""
    pairs.served(by[0].worker_id, by[1].worker_id, now)
    return pairs.note(*failed, now)


def _suspect(pairs: InconclusivePairs, failed: tuple[Worker, Worker], by: tuple[Worker, Worker]) -> float:
    """Requests that make `failed[1]` a suspect (times 1, 2, ...); returns the last one's time."""
    for k in range(1, SUSPECT_ROUNDS + 1):
        assert pairs.suspected(float(k), EVERYONE) == NO_SUSPECTS
        assert _failed_then_served(pairs, failed, by, float(k)) == []
    return float(SUSPECT_ROUNDS)


def test_one_partner_a_broken_worker_is_suspected_probed_then_convicted() -> None:
    p1, d1, d2 = _workers("p1", "d1", "d2")  # d1 is broken
    pairs = InconclusivePairs()
    now = _suspect(pairs, (p1, d1), (p1, d2))
    assert pairs.suspected(now, EVERYONE) == Suspects(frozenset(), frozenset({d1.worker_id}))
    for _ in range(PROBES):  # without d1, p1 serves every request in its first round
        now += 0.5
        assert d1.worker_id in pairs.suspected(now, EVERYONE).decode
        pairs.served(p1.worker_id, d2.worker_id, now, first_round=True)
        pairs.check_invariants()
    assert pairs.suspected(now, EVERYONE) == NO_SUSPECTS  # passed: on to d1's retrial
    assert d1.breaker.failures == 0
    assert _failed_then_served(pairs, (p1, d1), (p1, d2), now + 1) == [d1]
    assert not d1.breaker.closed and d1.breaker.failures == 3  # the streak's rounds, up to the threshold
    assert p1.breaker.failures == d2.breaker.failures == 0


def test_one_partner_a_probe_without_first_rounds_does_not_pass() -> None:
    p1, d1, d2 = _workers("p1", "d1", "d2")
    pairs = InconclusivePairs()
    now = _suspect(pairs, (p1, d1), (p1, d2))
    for _ in range(2 * PROBES):  # served in retries only: they prove nothing
        now += 0.5
        pairs.served(p1.worker_id, d2.worker_id, now)
    assert d1.worker_id in pairs.suspected(now, EVERYONE).decode
    assert _failed_then_served(pairs, (p1, d1), (p1, d2), now + 1) == []
    assert d1.breaker.failures == 0


def test_one_partner_a_partner_failing_every_other_pair_fails_its_probe() -> None:
    # One decode worker failing every request's first round: p1, which the policy tries first,
    # fails each, and p2 serves the retry, until p1 is avoided and p2 fails first.
    p1, p2, d1 = _workers("p1", "p2", "d1")
    pairs = InconclusivePairs()
    probes = 0
    for k in range(10 * (SUSPECT_ROUNDS + 1)):
        if p1.worker_id in pairs.suspected(float(k), EVERYONE).prefill:
            probes += 1
            _failed_then_served(pairs, (p2, d1), (p1, d1), float(k))
        else:
            _failed_then_served(pairs, (p1, d1), (p2, d1), float(k))
        pairs.check_invariants()
    assert probes >= 5
    assert p1.breaker.failures == p2.breaker.failures == 0


def test_one_partner_the_partner_failing_with_a_working_worker_clears_the_suspect() -> None:
    # Within one request, in either order: d1 failed with p2 too, and p2 serves a pair since.
    for order in range(2):
        p1, p2, p3, d1 = _workers("p1", "p2", "p3", "d1")
        pairs = InconclusivePairs()
        now = _suspect(pairs, (p1, d1), (p3, d1))
        assert p1.worker_id in pairs.suspected(now, EVERYONE).prefill
        now += 1
        pairs.served(p3.worker_id, d1.worker_id, now)
        failed = [(p1, d1), (p2, d1)] if order else [(p2, d1), (p1, d1)]
        for pair in failed:
            assert pairs.note(*pair, now) == []
        assert p1.worker_id in pairs.suspected(now, EVERYONE).prefill  # p2 may be broken too, so far
        pairs.served(p2.worker_id, d1.worker_id, now + 1)
        assert pairs.suspected(now + 1, EVERYONE) == NO_SUSPECTS
        pairs.check_invariants()


def test_one_partner_two_broken_workers_sharing_their_partner_are_both_convicted() -> None:
    # Three prefill workers and one decode worker x; p1 and p2 are stuck, so every pair with
    # them is inconclusive, and p3 serves each request, whose rounds meet p1 and p2 in either
    # order. x failing with the other broken worker, which never serves, clears neither.
    p1, p2, p3, x = _workers("p1", "p2", "p3", "x")
    pairs = InconclusivePairs()
    now = 0.0
    for k in range(SUSPECT_ROUNDS):
        now += 1
        pairs.served(p3.worker_id, x.worker_id, now)
        for pair in [(p1, x), (p2, x)] if k % 2 else [(p2, x), (p1, x)]:
            assert pairs.note(*pair, now) == []
    assert pairs.suspected(now, EVERYONE).prefill == {p1.worker_id, p2.worker_id}
    for _ in range(PROBES):  # without them, p3 serves each request in its first round
        now += 0.5
        pairs.served(p3.worker_id, x.worker_id, now, first_round=True)
    assert pairs.suspected(now, EVERYONE) == NO_SUSPECTS  # on to their retrial
    now += 1
    pairs.served(p3.worker_id, x.worker_id, now)
    assert pairs.note(p1, x, now) == [p1] and pairs.note(p2, x, now) == [p2]
    assert not p1.breaker.closed and not p2.breaker.closed
    assert p3.breaker.failures == x.breaker.failures == 0
    pairs.check_invariants()


def test_one_partner_a_partner_that_recovered_clears_the_suspect_at_its_retrial() -> None:
    p1, p2, d1 = _workers("p1", "p2", "d1")  # d1 had a bad spell, failing only with p1
    pairs = InconclusivePairs()
    now = _suspect(pairs, (p1, d1), (p2, d1))
    for _ in range(PROBES):
        now += 0.5
        pairs.served(p2.worker_id, d1.worker_id, now, first_round=True)
    pairs.served(p1.worker_id, d1.worker_id, now + 1, first_round=True)  # the retrial serves
    assert _failed_then_served(pairs, (p1, d1), (p2, d1), now + 2) == []  # a new streak
    assert pairs.suspected(now + 2, EVERYONE) == NO_SUSPECTS
    assert p1.breaker.failures == 0


def test_one_partner_a_failure_with_the_partner_down_meanwhile_is_not_counted() -> None:
    # d1 served nothing between p1's failures with it (other decode workers served p1's requests):
    # d1 may have been down, so p1 is not suspected.
    p1, p2, d1, d2 = _workers("p1", "p2", "d1", "d2")
    pairs = InconclusivePairs()
    for k in range(5 * SUSPECT_ROUNDS):
        _failed_then_served(pairs, (p1, d1), (p2, d2), float(k))
    assert pairs.suspected(100.0, EVERYONE) == NO_SUSPECTS


def test_one_partner_with_one_worker_of_each_role_nobody_is_suspected() -> None:
    p1, d1 = _workers("p1", "d1")
    pairs = InconclusivePairs()
    for k in range(2 * PROBES):
        assert _failed_then_served(pairs, (p1, d1), (p1, d1), float(k)) == []
        pairs.served(p1.worker_id, d1.worker_id, k + 0.5, first_round=True)
    assert pairs.suspected(2.0 * PROBES, EVERYONE) == NO_SUSPECTS
    assert p1.breaker.failures == d1.breaker.failures == 0


def test_one_partner_a_suspicion_ends_a_window_after_the_last_failure() -> None:
    p1, d1, d2 = _workers("p1", "d1", "d2")
    pairs = InconclusivePairs()
    now = _suspect(pairs, (p1, d1), (p1, d2))
    assert pairs.suspected(now + WITHIN_S - 1, EVERYONE) != NO_SUSPECTS
    assert pairs.suspected(now + WITHIN_S, EVERYONE) == NO_SUSPECTS
    pairs.check_invariants()


def test_one_partner_streaks_are_bounded() -> None:
    p1 = _workers("p1")[0]
    pairs = InconclusivePairs()
    for k in range(3 * 4096):  # decode pods churning, each failing once with p1
        d = Worker(f"http://d{k}:8000", CONFIG)
        pairs.note(p1, d, float(k) * WITHIN_S)
    assert len(pairs._streaks) <= 4096 + 1
    pairs.check_invariants()


def test_one_partner_a_worker_triangulation_shows_at_fault_is_not_probed() -> None:
    # d1 failed with p1, then with p2 only: triangulation blames it each round from the one when
    # p2 has served since, and it is not avoided (that would stop the rounds being counted).
    p1, p2, d1, d2 = _workers("p1", "p2", "d1", "d2")
    pairs = InconclusivePairs()
    _failed_then_served(pairs, (p1, d1), (p1, d2), 1.0)
    assert _failed_then_served(pairs, (p2, d1), (p1, d2), 2.0) == []
    for k in range(3, 3 + SUSPECT_ROUNDS):
        assert _failed_then_served(pairs, (p2, d1), (p2, d2), float(k)) == [d1]
        assert pairs.suspected(float(k), EVERYONE) == NO_SUSPECTS
        pairs.check_invariants()
    assert not d1.breaker.closed


def test_one_partner_a_request_s_failed_pairs_are_weighed_together_whatever_their_order() -> None:
    # At w's retrial x fails, in one request, with w and with p2, which served a pair since its
    # last such failure: x failing without w clears w, whichever pair failed first.
    for order in range(2):
        w, p2, p3, x = _workers("w", "p2", "p3", "x")
        pairs = InconclusivePairs()
        now = _suspect(pairs, (w, x), (p2, x))
        for _ in range(PROBES):
            now += 0.5
            pairs.served(p2.worker_id, x.worker_id, now, first_round=True)
        now += 1
        pairs.served(p3.worker_id, x.worker_id, now)  # the third round serves
        failed = [(w, x), (p2, x)] if order else [(p2, x), (w, x)]
        assert pairs.note_request(failed, now) == []
        assert w.breaker.failures == 0 and pairs.suspected(now, EVERYONE) == NO_SUSPECTS
        pairs.check_invariants()


def test_one_partner_a_worker_failing_with_two_partners_in_one_request_has_no_streak() -> None:
    p1, p2, d1, d2, d3 = _workers("p1", "p2", "d1", "d2", "d3")
    for order in range(2):
        pairs = InconclusivePairs()
        for k in range(2 * SUSPECT_ROUNDS):
            pairs.served(p2.worker_id, d3.worker_id, float(k))
            failed = [(p1, d1), (p1, d2)] if order else [(p1, d2), (p1, d1)]
            assert pairs.note_request(failed, float(k)) == []
        assert pairs.suspected(100.0, EVERYONE) == NO_SUSPECTS and p1.worker_id not in pairs._streaks


def test_one_partner_a_suspect_whose_partner_left_the_pool_is_cleared() -> None:
    # x's pod is rescheduled under a new address: nothing can probe w any more.
    w, p2, x = _workers("w", "p2", "x")
    pairs = InconclusivePairs()
    now = _suspect(pairs, (w, x), (p2, x))
    assert pairs.suspected(now, {w.worker_id, p2.worker_id, x.worker_id}).prefill == {w.worker_id}
    assert pairs.suspected(now + 1, {w.worker_id, p2.worker_id}) == NO_SUSPECTS
    assert pairs.suspected(now + 1, EVERYONE) == NO_SUSPECTS  # x back at that address: a new start
    assert _failed_then_served(pairs, (w, x), (p2, x), now + 2) == []
    pairs.check_invariants()


def test_one_partner_a_failure_with_a_partner_that_never_served_neither_ends_nor_extends_a_streak() -> None:
    # Two prefill and two decode workers: p2 stuck, d2 answering 500 to every pair; p1 and d1
    # serve each request. p2 fails with d1 and with d2, d2 with p1 and with p2, in one request or
    # apart, and p2 and d2 never serve: their failures with each other say nothing of either, and
    # each is weighed against its healthy partner.
    p1, p2, d1, d2 = _workers("p1", "p2", "d1", "d2")
    pairs = InconclusivePairs()
    now = 0.0
    while pairs.suspected(now, EVERYONE) == NO_SUSPECTS:
        assert now < 10 * SUSPECT_ROUNDS, "not suspected"
        now += 1
        pairs.served(p1.worker_id, d1.worker_id, now)  # the request's last round
        failed = [[(p2, d1), (p1, d2)], [(p2, d2)], [(p1, d2), (p2, d1)]][int(now) % 3]
        assert pairs.note_request(failed, now) == []
        pairs.check_invariants()
    assert pairs.suspected(now, EVERYONE) == Suspects(frozenset({p2.worker_id}), frozenset({d2.worker_id}))
    for _ in range(PROBES):  # without them, p1 and d1 serve each request in its first round
        now += 0.5
        pairs.served(p1.worker_id, d1.worker_id, now, first_round=True)
    assert pairs.suspected(now, EVERYONE) == NO_SUSPECTS  # on to their retrial
    now += 1
    pairs.served(p1.worker_id, d1.worker_id, now)
    assert pairs.note_request([(p2, d2)], now) == []  # the two broken ones together: nothing
    now += 1
    pairs.served(p1.worker_id, d1.worker_id, now)
    assert pairs.note_request([(p2, d1), (p1, d2)], now) == [p2, d2]
    assert not p2.breaker.closed and not d2.breaker.closed
    assert p1.breaker.failures == d1.breaker.failures == 0
    pairs.check_invariants()
