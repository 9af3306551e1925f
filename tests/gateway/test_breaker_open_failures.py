"""A failure that finds the breaker open leaves its cooldown as it was (`gateway/breaker.py`).

No request is sent to a worker whose breaker is open, so a failure that finds it open is a
request dispatched before it opened: to a hung or dead worker, those go on failing one by one,
each up to its read timeout (600 s by default). Each such failure opened the breaker again, so
its cooldown started over, and a worker that had recovered was kept out until the last of them
had failed, plus the cooldown, though they said nothing new (a success that finds the breaker
open was already dropped)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config.pool import BreakerConfig
from tests.gateway.chat_rig import chat_app, registry_worker, round_robin_gateway, served
from tests.support.wait import wait_until

KEYS = {"t": "sk"}
HEADERS = {"authorization": "Bearer sk"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
WAIT_S = 30.0


def test_failures_on_an_open_breaker_neither_count_nor_restart_its_cooldown() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2, cooldown_s=10))
    for now_s in (0.0, 1.0):
        breaker.on_failure(now_s, trial=None)
    assert breaker.state(1.0) is BreakerState.OPEN and breaker.failures == 2
    for now_s in (2.0, 6.0, 10.5):  # requests sent before it opened, failing one by one
        breaker.on_failure(now_s, trial=None)
    assert breaker.state(11.0) is BreakerState.HALF_OPEN  # `cooldown_s` after it opened
    assert breaker.failures == 2  # nor counted
    # Failed trials still open it again, for a cooldown from then.
    for now_s in (11.0, 11.5):
        breaker.on_failure(now_s, trial=breaker.on_dispatch(now_s))
    assert breaker.state(11.5) is BreakerState.OPEN
    breaker.on_failure(15.0, trial=None)
    assert breaker.state(21.5) is BreakerState.HALF_OPEN


async def test_a_request_sent_before_the_breaker_opened_failing_after_it_leaves_the_cooldown() -> None:
    # Through the request path: the request's attempt ends on a malformed answer (an HTML page
    # with a 200), which counts against the worker at once.
    cooldown_s = 3600.0
    started = asyncio.Event()
    finish = asyncio.Event()

    async def chat(_: web.Request) -> web.Response:
        started.set()
        await finish.wait()
        return web.Response(body=b"<html>engine error</html>", content_type="text/html")

    try:
        async with served("a", lambda _: chat_app(chat)) as urls:
            pool = {
                "name": "p",
                "models": ["m"],
                "workers": [urls["a"]],
                "health": {"interval_s": 3600},
                "retry_attempts": 0,
                "breaker": {"failure_threshold": 1, "cooldown_s": cooldown_s, "canary": {"enabled": False}},
            }
            async with round_robin_gateway([pool], KEYS, b"k") as gw:
                worker = registry_worker(gw.state, "p", urls["a"])
                chat_sent = gw.client.post("/v1/chat/completions", json=BODY, headers=HEADERS)
                early = asyncio.create_task(chat_sent)
                await wait_until(started.is_set, timeout_s=WAIT_S, what="the early request at the worker")
                opened_s = time.monotonic()
                worker.breaker.on_failure(opened_s, trial=None)  # another request's failure opens it
                assert worker.breaker.state(opened_s) is BreakerState.OPEN
                finish.set()
                assert (await early).status_code == 502
                await wait_until(lambda: worker.in_flight == 0, timeout_s=WAIT_S, what="the attempt ended")
                # Half-open `cooldown_s` after it opened, not after the early request failed.
                assert worker.breaker.state(opened_s + cooldown_s) is BreakerState.HALF_OPEN
                assert worker.breaker.failures == 1
    finally:
        finish.set()
