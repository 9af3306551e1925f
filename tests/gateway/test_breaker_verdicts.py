"""Whose fault a worker's 5xx is: a request that every worker answers with a 5xx must not open
their breakers (one tenant could take the pool down for all), while a worker that fails what
another serves still counts it (`outcome.HeldVerdicts`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.breaker import CircuitBreaker
from gateway.config import parse_config
from gateway.config.pool import BreakerConfig
from gateway.outcome import HeldVerdicts
from gateway.registry import Worker
from gateway.state import GatewayState
from policies import make_policy
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.transports import TRANSPORTS, through

SECRET = b"k"
NAMES = ("a", "b", "c")


@dataclass
class Workers:
    """Scripted workers: `status[name]` is what worker `name` answers every completion with."""

    status: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NAMES, 200))
    posts: list[str] = field(default_factory=list)


@dataclass
class Rig:
    client: httpx.AsyncClient
    workers: Workers
    state: GatewayState
    urls: dict[str, str]

    async def chat(self, model: str, stream: bool = False) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": stream}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk"}
        )

    def worker(self, pool: str, name: str) -> Worker:
        workers = self.state.registry.pools[pool].workers
        (worker,) = (w for w in workers.values() if w.url == self.urls[name])
        return worker

    def failures(self, pool: str) -> dict[str, int]:
        return {name: self.worker(pool, name).breaker.failures for name in NAMES if self._in(pool, name)}

    def _in(self, pool: str, name: str) -> bool:
        return any(w.url == self.urls[name] for w in self.state.registry.pools[pool].workers.values())


def _answer(status: int, stream: bool) -> web.Response:
    if status != 200:
        return web.json_response({"error": {"message": "worker says no"}}, status=status)
    choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if not stream:
        return web.json_response(
            {"id": "x", "object": "chat.completion", "choices": [choice], "usage": usage}
        )
    delta = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "hi"}}],
    }
    body = b"data: " + orjson.dumps(delta) + b"\n\ndata: [DONE]\n\n"
    return web.Response(body=body, content_type="text/event-stream")


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    workers = Workers()

    def app_for(name: str) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def chat(request: web.Request) -> web.Response:
            workers.posts.append(name)
            stream = (await request.json()).get("stream") is True
            return _answer(workers.status[name], stream)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/chat/completions", chat)
        return app

    runners, urls = [], {}
    for name in NAMES:
        runner, port = await serve_app(app_for(name))
        runners.append(runner)
        urls[name] = f"http://127.0.0.1:{port}"
    # Opens at the first failure counted: any wrong verdict shows as an open breaker.
    breaker = {"failure_threshold": 1, "cooldown_s": 3600}
    every = list(urls.values())
    config = parse_config(
        {
            "pools": [
                {
                    "name": "three",
                    "models": ["m3"],
                    "workers": every,
                    "retry_attempts": 2,
                    "breaker": breaker,
                },
                {
                    "name": "one",
                    "models": ["m1"],
                    "workers": every[:1],
                    "retry_attempts": 2,
                    "breaker": breaker,
                },
            ],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
            "scrape": {"enabled": False},
        }
    )
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            yield Rig(gw.client, workers, gw.state, urls)
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [500, 503])
async def test_a_request_every_worker_answers_with_a_5xx_opens_no_breaker(
    rig: Rig, transport: str, stream: bool, status: int
) -> None:
    through(rig.state, transport)
    rig.workers.status = dict.fromkeys(NAMES, status)
    for _ in range(3):  # a tenant's requests that no worker can take
        resp = await rig.chat("m3", stream)
        assert resp.status_code in (502, 503) and "error" in resp.json()
    assert len(rig.workers.posts) == 9  # each was still tried on every worker
    assert rig.failures("three") == dict.fromkeys(NAMES, 0)
    rig.workers.status = dict.fromkeys(NAMES, 200)
    resp = await rig.chat("m3", stream)  # the pool still serves everyone else
    assert resp.status_code == 200


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_that_fails_what_another_serves_is_counted(
    rig: Rig, transport: str, stream: bool
) -> None:
    through(rig.state, transport)
    rig.workers.status["a"] = 500
    for _ in range(3):  # round-robin: one of them starts at `a`
        assert (await rig.chat("m3", stream)).status_code == 200
    assert "a" in rig.workers.posts
    assert rig.failures("three") == {"a": 1, "b": 0, "c": 0}
    assert not rig.worker("three", "a").breaker.closed


async def test_a_5xx_then_another_workers_4xx_counts_against_neither(rig: Rig) -> None:
    rig.workers.status = {"a": 500, "b": 400, "c": 400}
    for _ in range(3):
        resp = await rig.chat("m3")
        assert resp.status_code in (400, 502)
    assert rig.failures("three") == dict.fromkeys(NAMES, 0)


async def test_a_lone_workers_5xx_still_counts(rig: Rig) -> None:
    # Nothing to compare with: the failure counts, as every other failure does.
    rig.workers.status["a"] = 500
    assert (await rig.chat("m1")).status_code == 502
    assert rig.failures("one") == {"a": 1}


def test_a_held_verdict_never_touches_a_breaker_that_left_the_closed_state() -> None:
    @dataclass
    class _Held:
        breaker: CircuitBreaker

    now_s = 100.0
    opened = _Held(CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=5)))
    verdicts = HeldVerdicts()
    verdicts.hold(cast(Worker, opened))
    opened.breaker.on_failure(now_s)  # other requests open it meanwhile ...
    now_s += 10
    assert opened.breaker.allows(now_s)
    opened.breaker.on_dispatch(now_s)  # ... and another request is its half-open trial
    verdicts.acquit()  # the held request's end frees nobody's trial
    assert not opened.breaker.allows(now_s)
    verdicts.hold(cast(Worker, opened))
    verdicts.convict(now_s)  # nor reopens it on evidence older than the trial
    opened.breaker.on_success()
    assert opened.breaker.closed and opened.breaker.failures == 0
