import math

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config import BreakerConfig, QuotaConfig
from gateway.quotas import TenantLimiter, TokenBucket


def test_bucket_refills_at_capacity_per_minute() -> None:
    bucket = TokenBucket(60, now_s=0.0)
    bucket.take(60, 0.0)
    assert bucket.wait_s(1, 0.0) == 1.0
    assert bucket.wait_s(1, 1.0) == 0.0
    assert math.isinf(bucket.wait_s(61, 1.0))


def test_rpm_limit_then_recovery() -> None:
    lim = TenantLimiter(QuotaConfig(rpm=2), now_s=0.0)
    assert lim.admit(10, 0.0) is None and lim.admit(10, 0.0) is None
    rej = lim.admit(10, 0.0)
    assert rej is not None and rej.retryable and rej.code == "rate_limit_exceeded"
    assert 29 < rej.retry_after_s <= 30
    lim.release(0, 0.0)
    assert lim.admit(10, 30.0) is None


def test_tpm_counts_prompt_then_completion_tokens() -> None:
    lim = TenantLimiter(QuotaConfig(tpm=100), now_s=0.0)
    assert lim.admit(40, 0.0) is None
    lim.release(50, 0.0)  # 90 of 100 spent
    rej = lim.admit(20, 0.0)
    assert rej is not None and rej.retryable
    too_big = lim.admit(101, 0.0)
    assert too_big is not None and not too_big.retryable and too_big.code == "insufficient_quota"


def test_concurrency_slot_comes_back_on_release() -> None:
    lim = TenantLimiter(QuotaConfig(max_concurrent=1), now_s=0.0)
    assert lim.admit(1, 0.0) is None
    assert lim.admit(1, 0.0) is not None
    lim.release(0, 0.0)
    assert lim.admit(1, 0.0) is None


def test_breaker_opens_half_opens_with_one_trial_and_closes() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=2, cooldown_s=5.0))
    b.on_failure(0.0)
    assert b.allows(0.0)
    b.on_failure(1.0)
    assert b.state(1.0) is BreakerState.OPEN and not b.allows(5.9)
    assert b.allows(6.0) and b.state(6.0) is BreakerState.HALF_OPEN
    b.on_dispatch(6.0)
    assert not b.allows(6.0)  # one trial at a time
    b.on_failure(6.5)
    assert b.state(7.0) is BreakerState.OPEN
    assert b.allows(11.5)
    b.on_dispatch(11.5)
    b.on_success()
    assert b.state(11.6) is BreakerState.CLOSED and b.allows(11.6)


def test_abandoned_trial_frees_the_slot() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=1.0))
    b.on_failure(0.0)
    b.on_dispatch(2.0)
    assert not b.allows(2.0)
    b.on_abandon()
    assert b.allows(2.0)
