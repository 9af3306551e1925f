"""A canary's verdict judges only the breaker's spell it was sent in (`gateway/breaker.py`).

A canary is sent while the breaker is closed (a lone 5xx left its worker suspected) or as a
half-open breaker's trial, and it may answer late (up to `canary.timeout_s`). One sent before the
breaker opened, or in an earlier half-open spell, whose failure arrived once the breaker was
half-open again re-opened it as if it were that spell's trial, before the spell's own canary
was even sent: a worker that had recovered was kept out for another cooldown. Now
`CircuitBreaker.canary_sent` hands out a `CanaryTicket` naming its spell, the canary carries it
to its verdict (`on_canary`: `sent`), and a verdict from an earlier spell neither opens, closes
nor counts; the worker stays suspected, and the spell's own canary decides."""

from __future__ import annotations

import time

from gateway.breaker import BreakerState, CanaryTicket, CircuitBreaker
from gateway.canary import CanaryVerdict
from gateway.config.pool import BreakerConfig, CanaryConfig
from tests.gateway.canary_rig import WAIT_S, gateway
from tests.support.wait import wait_until

CONFIG = BreakerConfig(failure_threshold=2, cooldown_s=10, canary=CanaryConfig(interval_s=1))


def _half_open_with_a_canary_sent_while_closed(breaker: CircuitBreaker) -> CanaryTicket:
    """A canary sent while the breaker was closed, still out when it opened (at 1.0, on request
    failures) and when it turned half-open (at 11.0): its ticket."""
    breaker.suspect()  # a lone 5xx
    sent = breaker.canary_sent(0.0)
    for now_s in (0.5, 1.0):
        breaker.on_failure(now_s, trial=None)
    assert breaker.state(11.0) is BreakerState.HALF_OPEN
    return sent


def test_a_failed_canary_sent_while_closed_does_not_reopen_a_half_open_breaker() -> None:
    breaker = CircuitBreaker(CONFIG)
    sent = _half_open_with_a_canary_sent_while_closed(breaker)
    breaker.on_canary(False, 11.5, sent=sent)
    assert breaker.state(11.5) is BreakerState.HALF_OPEN
    assert breaker.failures == 2 and breaker.canary_failures == 0  # nor counted
    # Still suspected: the spell's own canary is due at once, and decides.
    assert breaker.canary_due(11.5)
    own = breaker.canary_sent(11.5)
    breaker.on_canary(False, 12.0, sent=own)
    assert breaker.state(12.0) is BreakerState.OPEN


def test_a_passed_canary_sent_while_closed_does_not_close_a_half_open_breaker() -> None:
    breaker = CircuitBreaker(CONFIG)
    sent = _half_open_with_a_canary_sent_while_closed(breaker)
    breaker.on_canary(True, 11.5, sent=sent)
    assert breaker.state(11.5) is BreakerState.HALF_OPEN and breaker.canary_due(11.5)
    breaker.on_canary(True, 12.0, sent=breaker.canary_sent(11.5))
    assert breaker.closed


def test_a_canary_from_an_earlier_half_open_spell_does_not_judge_the_next() -> None:
    breaker = CircuitBreaker(CONFIG)
    for now_s in (0.0, 0.5):
        breaker.on_failure(now_s, trial=None)
    assert breaker.state(10.5) is BreakerState.HALF_OPEN and breaker.canary_due(10.5)
    breaker.canary_sent(10.5)  # the trial canary of this spell, slow to answer
    # No canary has judged this worker yet: client requests are trials too, and two fail.
    for now_s in (11.0, 11.5):
        breaker.on_failure(now_s, trial=breaker.on_dispatch(now_s))
    assert breaker.state(11.5) is BreakerState.OPEN
    assert breaker.state(21.5) is BreakerState.HALF_OPEN
    breaker.on_canary(False, 22.0)  # the last canary sent: the earlier spell's
    assert breaker.state(22.0) is BreakerState.HALF_OPEN and breaker.canary_due(22.0)


def test_a_failed_canary_from_before_a_bad_spell_does_not_count_once_closed_again() -> None:
    breaker = CircuitBreaker(CONFIG)
    sent = _half_open_with_a_canary_sent_while_closed(breaker)
    breaker.on_success(trial=breaker.on_dispatch(11.0))  # a client trial closes it
    assert breaker.closed
    breaker.on_canary(False, 11.5, sent=sent)
    assert breaker.failures == 0 and breaker.canary_failures == 0
    assert breaker.canary_due(11.5)  # the worker stays suspected: a canary of this spell decides
    breaker.on_canary(False, 12.0, sent=breaker.canary_sent(11.5))
    assert breaker.closed and breaker.failures == 1 and breaker.canary_failures == 1


async def test_a_canary_sent_before_the_breaker_opened_does_not_reopen_it_through_the_service() -> None:
    # The canaries' service: the canary sent while `a` was closed answers once `a` is half-open.
    # A long interval: no other canary is due until the test sends one (`check` at a later time).
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 3600}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        a = rig.worker("p", "a").breaker
        rig.workers.held = True
        rig.workers.broken.add("a")
        a.suspect()  # as a lone 5xx leaves it
        await wait_until(lambda: rig.workers.canaries == ["a"], timeout_s=WAIT_S, what="a's canary")
        a.on_failure(time.monotonic() - 3600, trial=None)  # opened a cooldown ago: half-open now
        assert a.state(time.monotonic()) is BreakerState.HALF_OPEN
        rig.workers.release.set()
        await rig.canaries_ended(CanaryVerdict.FAILED, 1)
        assert a.state(time.monotonic()) is BreakerState.HALF_OPEN and a.suspected
        # The worker recovered: the half-open spell's own canary passes and closes the breaker.
        rig.workers.broken.clear()
        rig.canaries.check(time.monotonic() + 3600)
        await rig.canaries_passed(1)
        assert rig.workers.canaries == ["a", "a"] and a.closed
