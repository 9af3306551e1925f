"""A request's verdict applies to the breaker state it was sent under (`gateway/breaker.py`).

No request is sent to a worker whose breaker is open, so a success that finds it open is a request
dispatched before it opened: a long stream, say, that a worker keeps decoding while every new
request fails on it. That success closed the breaker at once, with no cooldown and no trial,
and every tenant's requests went back to the broken worker until it failed
`failure_threshold` more of them; with many such streams the breaker flapped for as long as
they lasted."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

from gateway.breaker import BreakerState
from tests.gateway.chat_rig import ChatRig, chat_answer, chat_app, round_robin_gateway, served
from tests.support.wait import wait_until

KEYS = {"t": "sk", "u": "sk-u"}
LONG = "long"  # a prompt whose answer the worker holds until `ScriptedWorker.finish` is set


@dataclass
class ScriptedWorker:
    """One scripted worker: `LONG` waits for `finish`; every other request gets a 200 that is
    not an answer (an HTML page) once `broken`, which counts against the worker at once."""

    broken: bool = False
    posts: int = 0
    long_started: asyncio.Event = field(default_factory=asyncio.Event)
    finish: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Rig(ChatRig):
    scripted: ScriptedWorker

    async def chat(self, prompt: str = "hi", *, tenant: str = "t") -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}
        )


@contextlib.asynccontextmanager
async def gateway(**breaker: Any) -> AsyncIterator[Rig]:
    scripted = ScriptedWorker()

    async def chat(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        scripted.posts += 1
        if body["messages"][0]["content"] == LONG:
            scripted.long_started.set()
            await scripted.finish.wait()
            return chat_answer(False, "done")
        if scripted.broken:
            return web.Response(body=b"<html>engine error</html>", content_type="text/html")
        return chat_answer(False)

    try:
        async with served("a", lambda _: chat_app(chat)) as urls:
            pool = {
                "name": "p",
                "models": ["m"],
                "workers": [urls["a"]],
                "health": {"interval_s": 3600},
                "retry_attempts": 0,
                "breaker": breaker,
            }
            async with round_robin_gateway([pool], KEYS, b"k") as gw:
                yield Rig(gw.client, gw.state, urls, scripted)
    finally:
        scripted.finish.set()


async def test_a_success_sent_before_the_breaker_opened_does_not_close_it() -> None:
    async with gateway(failure_threshold=1, cooldown_s=3600) as rig:
        breaker = rig.worker("p", "a").breaker
        long = asyncio.create_task(rig.chat(LONG))
        await wait_until(rig.scripted.long_started.is_set, timeout_s=30, what="the long answer begun")
        rig.scripted.broken = True  # new requests fail on it from now on
        assert (await rig.chat()).status_code == 502
        assert breaker.state(time.monotonic()) is BreakerState.OPEN
        rig.scripted.finish.set()  # the long answer, begun before, is served
        assert (await long).status_code == 200
        assert breaker.state(time.monotonic()) is BreakerState.OPEN
        posts = rig.scripted.posts
        resp = await rig.chat(tenant="u")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker_available"
        assert rig.scripted.posts == posts  # nothing more went to the broken worker


async def test_a_half_open_breakers_trial_success_still_closes_it() -> None:
    async with gateway(failure_threshold=1, cooldown_s=0.2) as rig:
        breaker = rig.worker("p", "a").breaker
        rig.scripted.broken = True
        assert (await rig.chat()).status_code == 502
        rig.scripted.broken = False
        await wait_until(lambda: breaker.allows(time.monotonic()), timeout_s=30, what="the trial")
        assert (await rig.chat(tenant="u")).status_code == 200
        assert breaker.closed
