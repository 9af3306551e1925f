"""Who judges a half-open breaker (`gateway/breaker.py`).

A tenant whose own input fails a healthy worker (a "poison" tenant: vLLM's 500 for one input)
cannot open a closed breaker: its lone 5xx leaves the worker suspected and the gateway's canary
decides. Once a breaker is open for a real bad spell, though, the one trial request let through
after the cooldown was judged alone, and a tenant sending such requests as fast as it can won
that race each time: its 500 re-opened the breaker for another cooldown, again and again, and
every other tenant stayed shut out of a worker that had long recovered. Now the gateway's own
canary is the trial where canaries reach the worker, and elsewhere (P/D pools, chat-only pools)
a trial's failure counts as a closed breaker's does: `failure_threshold` of them in a row."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from gateway.breaker import BreakerState
from gateway.canary import CanaryVerdict
from tests.gateway.canary_rig import POISON, WAIT_S, Rig, gateway
from tests.support.wait import wait_until


async def _bad_spell(rig: Rig) -> None:
    """Worker `a` fails everything until its canary opens its breaker (threshold 1), then recovers."""
    breaker = rig.worker("p", "a").breaker
    rig.workers.broken.add("a")
    assert (await rig.chat()).status_code == 502  # a lone 500: its canary decides
    await wait_until(lambda: not breaker.closed, timeout_s=WAIT_S, what="a's breaker opened")
    assert rig.canaries.counts[CanaryVerdict.FAILED] == 1
    rig.workers.broken.clear()


async def test_a_poison_tenant_cannot_keep_a_recovered_workers_breaker_open() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 0.2, "canary": {"interval_s": 0.05}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        a = rig.worker("p", "a").breaker
        await _bad_spell(rig)
        statuses: Counter[int] = Counter()
        stop = asyncio.Event()

        async def poison() -> None:
            # A request the moment the breaker lets one through: it wins every race for the trial.
            while not stop.is_set():
                await wait_until(lambda: stop.is_set() or a.allows(time.monotonic()), timeout_s=WAIT_S)
                if not stop.is_set():
                    statuses[(await rig.chat(POISON)).status_code] += 1

        task = asyncio.create_task(poison())
        try:
            await wait_until(lambda: a.closed, timeout_s=WAIT_S, what="a's breaker closed")
        finally:
            stop.set()
            await task
        # The trial was the gateway's canary, which passed: no tenant's request was one.
        assert rig.canaries.counts[CanaryVerdict.PASSED] >= 1
        assert set(statuses) <= {502}  # each a lone 500 of the closed breaker's: a canary's
        resp = await rig.chat(tenant="u")
        assert resp.status_code == 200 and a.closed


async def test_a_half_open_breaker_lets_no_client_trial_through_while_its_canary_decides() -> None:
    # The trial canary is held: its timeout (which would hand the trial to clients) never comes.
    breaker = {"failure_threshold": 1, "cooldown_s": 0.2, "canary": {"interval_s": 0.05, "timeout_s": 600}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        a = rig.worker("p", "a").breaker
        await _bad_spell(rig)
        rig.workers.held = True  # the trial's canary waits for the test
        await wait_until(lambda: len(rig.workers.canaries) == 2, timeout_s=WAIT_S, what="the trial canary")
        assert a.state(time.monotonic()) is BreakerState.HALF_OPEN and not a.allows(time.monotonic())
        rig.workers.posts.clear()
        resp = await rig.chat(POISON)
        assert resp.status_code == 503 and rig.workers.posts == []  # no tenant's request is the trial
        rig.workers.release.set()
        await wait_until(lambda: a.closed, timeout_s=WAIT_S, what="a's breaker closed by its canary")
        assert (await rig.chat(tenant="u")).status_code == 200


async def test_a_worker_failing_everything_stays_open_through_its_trial_canaries() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 0.2, "canary": {"interval_s": 0.05}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        a = rig.worker("p", "a").breaker
        rig.workers.broken.add("a")
        assert (await rig.chat()).status_code == 502
        # Each cooldown ends in a trial canary, which fails and re-opens the breaker at once.
        await rig.canaries_ended(CanaryVerdict.FAILED, 4)
        rig.workers.posts.clear()
        for _ in range(3):
            assert (await rig.chat(tenant="u")).status_code == 503
        assert rig.workers.posts == [] and not a.closed


async def test_without_canaries_a_trial_failure_counts_as_a_closed_breakers_does() -> None:
    """A pool whose workers serve no `/v1/completions` (a chat-only front end: its canaries get a
    404, which decides nothing): client requests are the trials, and one failure does not re-open
    the breaker when the next trial, another tenant's, succeeds."""
    breaker = {"failure_threshold": 3, "cooldown_s": 0.2, "canary": {"interval_s": 0.05}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.refusal = 404
        a = rig.worker("p", "a").breaker
        for _ in range(3):  # a bad spell no canary saw: connections lost, say
            a.on_failure(time.monotonic(), trial=None)
        assert a.state(time.monotonic()) is BreakerState.OPEN
        await wait_until(lambda: a.allows(time.monotonic()), timeout_s=WAIT_S, what="a half-open")
        assert (await rig.chat(POISON)).status_code == 502  # the poison tenant's trial fails
        assert a.state(time.monotonic()) is BreakerState.HALF_OPEN
        await wait_until(lambda: a.allows(time.monotonic()), timeout_s=WAIT_S, what="the next trial")
        assert (await rig.chat(tenant="u")).status_code == 200  # another tenant's trial closes it
        assert a.closed


async def test_without_canaries_a_worker_failing_every_trial_is_opened_again() -> None:
    breaker = {"failure_threshold": 2, "cooldown_s": 0.2, "canary": {"enabled": False}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        a = rig.worker("p", "a").breaker
        rig.workers.broken.add("a")
        for _ in range(2):
            a.on_failure(time.monotonic(), trial=None)
        for _ in range(2):  # two failed trials in a row, as two failures open a closed breaker
            await wait_until(lambda: a.allows(time.monotonic()), timeout_s=WAIT_S, what="a trial")
            assert (await rig.chat()).status_code == 502
        assert a.state(time.monotonic()) is BreakerState.OPEN
