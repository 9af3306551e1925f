"""A worker's failure that no other worker's answer compared (a lone 5xx, its own error event in a
stream) counts against no worker by itself, since a client's input can cause it
(`outcome.HeldVerdicts`); it leaves the worker suspected, and the gateway's own canary decides
(`gateway/canary.py`): a one-token `/v1/completions` of a fixed prompt that no client shapes.

So a worker that fails everything while its `/health` passes is shut out even when nothing
retries its requests (`retry_attempts: 0`), and one ending every stream in its own error event
is shut out too; a tenant's input that fails a healthy worker never opens its breaker (the canary
passes); and a worker has one canary in flight at most, cancelled when it leaves its pool."""

from __future__ import annotations

import time

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.canary import CanaryVerdict
from gateway.config.pool import BreakerConfig, CanaryConfig
from tests.gateway.canary_rig import POISON, WAIT_S, gateway
from tests.support.wait import wait_until


async def test_a_worker_failing_everything_without_retries_is_shut_out_by_its_canaries() -> None:
    # The breaker's defaults but its cooldown: three canaries failed in a row open it.
    async with gateway(retry_attempts=0, breaker={"cooldown_s": 3600}) as rig:
        rig.workers.broken.add("a")
        statuses = sorted([(await rig.chat()).status_code for _ in range(2)])
        assert statuses == [200, 502] and sorted(rig.workers.posts) == ["a", "b"]
        # One lone 500 was enough: the canaries go on, one an interval, until the breaker opens.
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        assert rig.canaries.counts[CanaryVerdict.FAILED] == 3 and set(rig.workers.canaries) == {"a"}
        assert rig.canary_series() == {("a", "failed"): 3.0}
        rig.workers.posts.clear()
        for _ in range(4):  # every tenant's requests now go to the healthy worker
            assert (await rig.chat(tenant="u")).status_code == 200
        assert rig.workers.posts == ["b"] * 4


async def test_a_tenants_input_that_fails_a_healthy_worker_never_opens_its_breaker() -> None:
    # Opens at the first failure counted: any wrong verdict shows as an open breaker.
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway(retry_attempts=0, breaker=breaker) as rig:
        for passed in range(2, 8, 2):
            for _ in range(4):  # round robin: two on each worker, each the request's only attempt
                assert (await rig.chat(POISON)).status_code == 502
            # Each worker's canary passes: the suspicion is cleared, nothing is counted.
            await rig.canaries_passed(passed)
            assert rig.failures("ab") == {"a": 0, "b": 0} and rig.closed("a") and rig.closed("b")
        assert rig.canaries.counts[CanaryVerdict.FAILED] == 0
        assert not any(rig.worker("p", name).breaker.suspected for name in "ab")
        rig.workers.posts.clear()
        for _ in range(4):  # another tenant's requests still go to both workers
            assert (await rig.chat(tenant="u")).status_code == 200
        assert sorted(rig.workers.posts) == ["a", "a", "b", "b"]


async def test_a_worker_ending_every_stream_in_its_own_error_event_is_shut_out() -> None:
    async with gateway(breaker={"cooldown_s": 3600}) as rig:
        rig.workers.stream_errors.add("a")
        for _ in range(2):  # one on each worker; `a`'s stream ends in its error event
            resp = await rig.chat(stream=True)
            assert resp.status_code == 200
        assert sorted(rig.workers.posts) == ["a", "b"]
        assert rig.failures("a") == {"a": 0}  # the error event itself counted against no worker
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        assert rig.canaries.counts[CanaryVerdict.FAILED] == 3
        rig.workers.posts.clear()
        for _ in range(4):
            resp = await rig.chat(tenant="u", stream=True)
            assert resp.status_code == 200 and b"upstream_stream_error" not in resp.content
        assert rig.workers.posts == ["b"] * 4


async def test_a_worker_has_one_canary_in_flight_at_most() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05, "timeout_s": 0.5}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.held = True  # canaries get no answer until released
        assert (await rig.chat(POISON)).status_code == 502
        await wait_until(lambda: rig.workers.canaries == ["a"], timeout_s=WAIT_S)
        for _ in range(3):  # more suspicions while its canary is in flight
            assert (await rig.chat(POISON)).status_code == 502
        assert rig.canaries.in_flight == 1
        # The first canary times out (which decides nothing), and only then is the next sent.
        await wait_until(lambda: len(rig.workers.canaries) == 2, timeout_s=WAIT_S)
        assert rig.canaries.counts == {CanaryVerdict.INCONCLUSIVE: 1}
        assert rig.workers.most_in_flight == 1 and rig.canaries.in_flight == 1
        rig.workers.held = False
        rig.workers.release.set()
        await wait_until(lambda: rig.canaries.counts[CanaryVerdict.PASSED] == 1, timeout_s=WAIT_S)
        assert rig.failures("a") == {"a": 0} and rig.closed("a") and rig.workers.most_in_flight == 1


async def test_a_workers_canary_is_cancelled_when_it_leaves_its_pool() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway(retry_attempts=0, breaker=breaker) as rig:
        rig.workers.held = True
        rig.workers.broken.add("a")
        for _ in range(2):
            await rig.chat()
        await wait_until(lambda: rig.workers.canaries == ["a"], timeout_s=WAIT_S)
        a = rig.worker("p", "a")
        rig.state.registry.pools["p"].set_urls([rig.urls["b"]])  # discovery lost it
        await wait_until(lambda: rig.canaries.in_flight == 0, timeout_s=WAIT_S)
        assert sum(rig.canaries.counts.values()) == 0 and a.breaker.closed


async def test_a_worker_that_left_its_pool_takes_its_canary_counts_with_it() -> None:
    breaker = {"failure_threshold": 5, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway(retry_attempts=0, breaker=breaker) as rig:
        rig.workers.broken.add("a")
        for _ in range(2):
            await rig.chat()
        counts = rig.canaries.by_worker
        await wait_until(lambda: any(key[1] == rig.urls["a"] for key in counts), timeout_s=WAIT_S)
        rig.state.registry.pools["p"].set_urls([rig.urls["b"]])  # discovery lost it
        # Gone without a scrape of /metrics: the counts of a worker that left are bounded.
        await wait_until(lambda: not counts, timeout_s=WAIT_S, what="a's counts forgotten")


async def test_failed_canaries_open_the_breaker_whatever_succeeds_between_them() -> None:
    """A worker failing every generation (and its canaries) while it answers `/tokenize`, which
    needs no engine: a tenant's tokenize calls between the canaries must not keep it in."""
    breaker = {"cooldown_s": 3600, "canary": {"interval_s": 0.3}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.broken.add("a")
        assert (await rig.chat()).status_code == 502
        counts = rig.canaries.counts
        for n in range(1, 3):  # after each failed canary, a success of the same worker
            await rig.canaries_ended(CanaryVerdict.FAILED, n)
            assert (await rig.tokenize()).status_code == 200
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        assert counts[CanaryVerdict.FAILED] == 3 and rig.worker("p", "a").breaker.canary_failures == 3
        resp = await rig.chat(tenant="u")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker_available"


async def test_a_worker_its_health_check_took_down_gets_no_canary_until_it_is_back() -> None:
    breaker = {"cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway("a", breaker=breaker) as rig:
        a = rig.worker("p", "a")
        a.breaker.suspect()  # as a lone 5xx leaves it, and its health check takes it down
        a.healthy = False
        rig.canaries.check(time.monotonic() + 3600)
        assert rig.canaries.in_flight == 0 and a.breaker.suspected and rig.workers.canaries == []
        a.healthy = True  # back: the suspicion it kept is settled by a canary
        await rig.canaries_passed(1)
        assert rig.workers.canaries == ["a"] and not a.breaker.suspected


def test_the_breakers_canary_bounds_and_verdicts() -> None:
    config = BreakerConfig(failure_threshold=2, cooldown_s=10, canary=CanaryConfig(interval_s=1))
    breaker = CircuitBreaker(config)
    assert not breaker.canary_due(0.0)  # nothing suspected
    breaker.suspect()
    assert breaker.canary_due(0.0)
    breaker.canary_sent(0.0)
    breaker.suspect()  # a suspicion while the canary is out waits for the interval
    assert not breaker.canary_due(0.5) and breaker.canary_due(1.0)
    breaker.on_canary(None, 1.0)  # a timeout or a 4xx: nothing decided
    assert breaker.failures == 0 and breaker.closed
    breaker.canary_sent(1.0)
    breaker.on_canary(False, 1.5)  # failed: counted, and the next canary stays due
    assert breaker.failures == 1 and breaker.suspected and breaker.canary_due(2.0)
    breaker.canary_sent(2.0)
    breaker.on_canary(False, 2.5)
    assert breaker.state(2.5) is BreakerState.OPEN and not breaker.canary_due(3.5)
    breaker.on_canary(False, 3.0)  # a verdict that finds the breaker open is dropped
    assert breaker.failures == 2
    # Half-open after the cooldown: a canary is due, and its failure re-opens the breaker.
    assert breaker.state(12.5) is BreakerState.HALF_OPEN and breaker.canary_due(12.5)
    breaker.canary_sent(12.5)
    breaker.on_canary(False, 13.0)
    assert breaker.state(13.0) is BreakerState.OPEN
    breaker.on_success(trial=None)  # a request sent before it opened: no verdict on an open breaker
    assert breaker.state(13.0) is BreakerState.OPEN and breaker.failures == 3
    # Half-open, a request's success closes it (a route needing no engine), but the row of
    # failed canaries goes on: the next one opens the breaker again.
    assert breaker.state(23.0) is BreakerState.HALF_OPEN
    breaker.on_success(trial=breaker.on_dispatch(23.0))
    assert breaker.closed and breaker.failures == 0 and breaker.canary_failures == 3
    assert breaker.canary_due(23.5)
    breaker.canary_sent(23.5)
    breaker.on_canary(None, 24.0)  # inconclusive: the row neither ends nor grows, the canaries go on
    assert breaker.closed and breaker.suspected and breaker.canary_failures == 3
    breaker.canary_sent(25.0)
    breaker.on_canary(False, 25.5)
    assert breaker.state(25.5) is BreakerState.OPEN
    assert breaker.state(35.5) is BreakerState.HALF_OPEN
    breaker.on_success(trial=breaker.on_dispatch(35.5))
    breaker.canary_sent(40.0)  # a passed canary ends the row and clears the suspicion
    breaker.on_canary(True, 40.5)
    assert breaker.closed and not breaker.suspected and breaker.failures == 0
    assert breaker.canary_failures == 0
    breaker.on_canary(None, 41.0)  # outside a row, inconclusive leaves nothing suspected
    assert not breaker.suspected


def test_failed_canaries_in_a_row_open_the_breaker_across_request_successes() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=3, cooldown_s=10))
    for n in range(1, 4):
        breaker.canary_sent(float(n))
        breaker.on_canary(False, n + 0.5)
        if n < 3:
            breaker.on_success(trial=None)  # a /tokenize served between the canaries
            assert breaker.closed and breaker.failures == 0
    assert breaker.state(3.5) is BreakerState.OPEN and breaker.canary_failures == 3
