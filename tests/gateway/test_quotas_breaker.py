import math

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config import QuotaConfig
from gateway.config.pool import BreakerConfig
from gateway.quotas import Rejection, TenantLimiter
from gateway.rate_buckets import TokenBucket


def test_bucket_refills_at_capacity_per_minute() -> None:
    bucket = TokenBucket(60, now_s=0.0)
    bucket.take(60, 0.0)
    assert bucket.wait_s(1, 0.0) == 1.0
    assert bucket.wait_s(1, 1.0) == 0.0
    assert math.isinf(bucket.wait_s(61, 1.0))


def _request(lim: TenantLimiter, prompt_tokens: int, now_s: float) -> Rejection | None:
    """Enter and admit, as the gateway does; a refused request leaves."""
    rej = lim.enter(now_s)
    if rej is not None:
        return rej
    rej = lim.admit(prompt_tokens, now_s)
    if rej is not None:
        lim.leave()
    return rej


def test_rpm_limit_then_recovery() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=2), now_s=0.0)
    assert _request(lim, 10, 0.0) is None and _request(lim, 10, 0.0) is None
    rej = _request(lim, 10, 0.0)
    assert rej is not None and rej.retryable and rej.code == "rate_limit_exceeded"
    assert 29 < rej.retry_after_s <= 30
    lim.release(0, 0.0)
    assert _request(lim, 10, 30.0) is None


def test_enter_charges_the_request_and_refuses_a_spent_rpm_before_the_body() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=2, max_concurrent=5), now_s=0.0)
    assert lim.enter(0.0) is None
    lim.leave()  # refused after its body was read (a 400): it still counted
    assert lim.enter(0.0) is None and lim.admit(1, 0.0) is None
    rej = lim.enter(0.0)
    assert rej is not None and rej.code == "rate_limit_exceeded"
    assert lim.in_flight == 1  # a refusal takes no slot


def test_tpm_counts_prompt_then_completion_tokens() -> None:
    lim = TenantLimiter(QuotaConfig(tpm=100), now_s=0.0)
    assert _request(lim, 40, 0.0) is None
    lim.release(50, 0.0)  # 90 of 100 spent
    rej = _request(lim, 20, 0.0)
    assert rej is not None and rej.retryable
    too_big = _request(lim, 101, 0.0)
    assert too_big is not None and not too_big.retryable and too_big.code == "insufficient_quota"
    assert lim.in_flight == 0


def test_tpm_is_reconciled_with_the_workers_prompt_count() -> None:
    # The estimate (characters / 4) was a quarter of what the worker counted: admitting on the
    # estimate alone let four times the quota through.
    lim = TenantLimiter(QuotaConfig(tpm=1000), now_s=0.0)
    served = 0
    while _request(lim, 50, 0.0) is None:
        lim.reconcile(50, 200, 0.0)
        lim.release(0, 0.0)
        served += 200
        assert served <= 2000
    assert served <= 1000 + 200


def test_reconcile_gives_back_an_overestimate_and_keeps_the_estimate_without_a_count() -> None:
    lim = TenantLimiter(QuotaConfig(tpm=100), now_s=0.0)
    assert _request(lim, 80, 0.0) is None
    lim.reconcile(80, None, 0.0)  # no usage reported: the estimate stands
    assert _request(lim, 30, 0.0) is not None
    lim.reconcile(80, 20, 0.0)  # the worker counted fewer tokens: 60 come back
    assert _request(lim, 70, 0.0) is None
    lim.reconcile(10, 0, 0.0)
    lim.reconcile(10, 0, 0.0)
    assert _request(lim, 101, 0.0) is not None  # never more than the capacity


def test_concurrency_slot_comes_back_on_release_or_leave() -> None:
    lim = TenantLimiter(QuotaConfig(max_concurrent=1), now_s=0.0)
    assert lim.enter(0.0) is None
    assert lim.enter(0.0) is not None
    lim.leave()
    assert _request(lim, 1, 0.0) is None
    assert lim.enter(0.0) is not None
    lim.release(0, 0.0)
    assert lim.enter(0.0) is None


def test_breaker_opens_half_opens_with_one_trial_and_closes() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=2, cooldown_s=5.0))
    b.on_failure(0.0, trial=None)
    assert b.allows(0.0)
    b.on_failure(1.0, trial=None)
    assert b.state(1.0) is BreakerState.OPEN and not b.allows(5.9)
    assert b.allows(6.0) and b.state(6.0) is BreakerState.HALF_OPEN
    trial = b.on_dispatch(6.0)
    assert trial is not None
    assert not b.allows(6.0)  # one trial at a time
    b.on_failure(6.5, trial=trial)  # a failed trial frees the slot: as many in a row as open a closed breaker
    assert b.state(6.5) is BreakerState.HALF_OPEN and b.allows(6.5)
    trial = b.on_dispatch(6.5)
    b.on_failure(7.0, trial=trial)
    assert b.state(7.0) is BreakerState.OPEN
    assert b.allows(12.0)
    trial = b.on_dispatch(12.0)
    b.on_failure(12.5, trial=trial)  # the count starts again at each half-open
    assert b.allows(12.5)
    trial = b.on_dispatch(12.5)
    b.on_success(trial=trial)
    assert b.state(12.6) is BreakerState.CLOSED and b.allows(12.6)


def test_abandoned_trial_frees_the_slot() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=1.0))
    b.on_failure(0.0, trial=None)
    trial = b.on_dispatch(2.0)
    assert trial is not None
    assert not b.allows(2.0)
    b.on_abandon(trial=None)  # a request that did not take the trial frees nothing
    assert not b.allows(2.0)
    b.on_abandon(trial=trial)
    assert b.allows(2.0)


def test_a_trial_from_an_earlier_half_open_spell_neither_frees_nor_judges_the_current_one() -> None:
    # A long trial (a stream) outlives its spell: a failed canary re-opens the breaker meanwhile,
    # and after the next cooldown another request is the trial.
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=1.0))
    b.on_failure(0.0, trial=None)
    old = b.on_dispatch(2.0)
    assert old is not None
    b.canary_sent(2.1)
    b.on_canary(False, 2.2)  # open again
    assert b.state(2.2) is BreakerState.OPEN
    current = b.on_dispatch(3.5)
    assert current is not None and not b.allows(3.5)
    b.on_abandon(trial=old)
    b.on_success(trial=old)
    b.on_failure(3.6, trial=old)
    assert b.state(3.6) is BreakerState.HALF_OPEN and not b.allows(3.6)  # still the current trial's
    b.on_success(trial=current)
    assert b.closed
