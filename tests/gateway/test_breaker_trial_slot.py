"""A half-open breaker's trial slot belongs to the request that took it (`gateway/breaker.py`).

A request sent before the breaker opened may end while it is half-open. Its verdict freed the
trial slot held by the request that did take it (or closed the breaker on a success that says
nothing of what opened it), so a second client trial went out while the first was still in
flight. Now `Worker.acquire` says whether the attempt took the trial, and `Attempt.end` tells
the breaker: only the trial's own verdict frees its slot or judges the breaker."""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.breaker import BreakerState
from tests.gateway.canary_rig import POISON, WAIT_S, Rig, gateway
from tests.support.wait import wait_until

# Client requests are the trials: no canaries; two failed trials in a row re-open the breaker.
BREAKER = {"failure_threshold": 2, "cooldown_s": 0.2, "canary": {"enabled": False}}


async def _early_and_trial(
    rig: Rig, early_prompt: str
) -> tuple[asyncio.Task[httpx.Response], asyncio.Task[httpx.Response]]:
    """A request `early_prompt` in flight on `a` when its breaker opens, and the trial sent once
    it is half-open, both held by the worker: (early, trial)."""
    a = rig.worker("p", "a").breaker
    for prompt in (early_prompt, "trial"):
        rig.workers.chat_holds[prompt] = asyncio.Event()
    early = asyncio.create_task(rig.chat(early_prompt, tenant="u"))
    await wait_until(lambda: rig.workers.posts == ["a"], timeout_s=WAIT_S, what="the early request")
    for _ in range(2):  # a bad spell the early request did not see
        a.on_failure(time.monotonic(), trial=None)
    assert a.state(time.monotonic()) is BreakerState.OPEN
    await wait_until(lambda: a.allows(time.monotonic()), timeout_s=WAIT_S, what="a half-open")
    trial = asyncio.create_task(rig.chat("trial"))
    await wait_until(lambda: len(rig.workers.posts) == 2, timeout_s=WAIT_S, what="the trial")
    assert not a.allows(time.monotonic())  # the trial is in flight
    return early, trial


async def test_a_request_sent_before_the_breaker_opened_does_not_free_the_trial() -> None:
    async with gateway("a", retry_attempts=0, breaker=BREAKER) as rig:
        a = rig.worker("p", "a").breaker
        early, trial = await _early_and_trial(rig, POISON)
        rig.workers.chat_holds[POISON].set()
        assert (await early).status_code == 502
        # Still one trial at a time: no second client request goes to the worker.
        assert a.state(time.monotonic()) is BreakerState.HALF_OPEN and not a.allows(time.monotonic())
        assert (await rig.chat(tenant="u")).status_code == 503 and len(rig.workers.posts) == 2
        rig.workers.chat_holds["trial"].set()
        assert (await trial).status_code == 200
        assert a.closed


async def test_a_success_sent_before_the_breaker_opened_does_not_close_it_half_open() -> None:
    async with gateway("a", retry_attempts=0, breaker=BREAKER) as rig:
        a = rig.worker("p", "a").breaker
        early, trial = await _early_and_trial(rig, "early")
        rig.workers.chat_holds["early"].set()
        assert (await early).status_code == 200
        assert a.state(time.monotonic()) is BreakerState.HALF_OPEN and not a.allows(time.monotonic())
        rig.workers.chat_holds["trial"].set()
        assert (await trial).status_code == 200
        assert a.closed  # the trial's own success closes it
