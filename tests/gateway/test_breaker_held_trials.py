"""A half-open breaker's client trial that fails with a 5xx waits for the request's fate, as a
closed breaker's failure does (`outcome.HeldVerdicts`).

Where no canary reaches the worker (prefill/decode pools, canaries off, a chat-only front end
answering them 404), client requests are a half-open breaker's trials, and a trial's 5xx was
judged alone: a tenant whose input every worker fails (vLLM's 500 for one prompt) re-opened a
recovered worker's breaker with `failure_threshold` such trials in a row, though the next
worker failed the same request. Now the 5xx counts only if another worker serves the request;
a worker failing what others serve is still opened again."""

from __future__ import annotations

import time

from gateway.breaker import BreakerState, CircuitBreaker
from tests.gateway.canary_rig import POISON, WAIT_S, Rig, gateway
from tests.support.wait import wait_until

BREAKER = {"failure_threshold": 2, "cooldown_s": 0.2, "canary": {"enabled": False}}


async def _half_open(rig: Rig, breaker: CircuitBreaker) -> None:
    for _ in range(2):  # a bad spell no canary saw: connections lost, say
        breaker.on_failure(time.monotonic(), trial=None)
    assert breaker.state(time.monotonic()) is BreakerState.OPEN
    await wait_until(lambda: breaker.allows(time.monotonic()), timeout_s=WAIT_S, what="half-open")


async def test_a_poison_tenant_cannot_reopen_a_recovered_worker_by_winning_its_trials() -> None:
    async with gateway("ab", retry_attempts=1, breaker=BREAKER) as rig:
        a = rig.worker("p", "a").breaker
        await _half_open(rig, a)
        for _ in range(4):  # each tries both workers, `a` as its half-open trial: both answer 500
            await wait_until(lambda: a.allows(time.monotonic()), timeout_s=WAIT_S, what="a's trial")
            rig.workers.posts.clear()
            assert (await rig.chat(POISON)).status_code == 502
            assert sorted(rig.workers.posts) == ["a", "b"]
            assert a.state(time.monotonic()) is BreakerState.HALF_OPEN
        await wait_until(lambda: a.allows(time.monotonic()), timeout_s=WAIT_S, what="a's trial")
        rig.workers.posts.clear()
        while "a" not in rig.workers.posts:  # another tenant's trial closes it
            assert (await rig.chat(tenant="u")).status_code == 200
        assert a.closed


async def test_a_worker_failing_what_others_serve_is_opened_again_by_its_trials() -> None:
    async with gateway("ab", retry_attempts=1, breaker=BREAKER) as rig:
        a = rig.worker("p", "a").breaker
        rig.workers.broken.add("a")
        await _half_open(rig, a)
        trials = 0
        for _ in range(8):  # round robin: `a` is tried in every other request at least
            await wait_until(lambda: a.allows(time.monotonic()), timeout_s=WAIT_S, what="a's trial")
            rig.workers.posts.clear()
            assert (await rig.chat(tenant="u")).status_code == 200  # `b` serves it
            trials += "a" in rig.workers.posts
            if a.state(time.monotonic()) is BreakerState.OPEN:
                break
        assert a.state(time.monotonic()) is BreakerState.OPEN
        assert trials == 2  # as many failed trials in a row as open a closed breaker
