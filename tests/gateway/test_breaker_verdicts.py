"""Whose fault a worker's 5xx or read timeout is: a request that every worker answers with a 5xx,
or that takes longer than `read_s` everywhere (a long non-streamed generation), must not open their
breakers (one tenant could take the pool down for all), while a worker that fails what another
serves still counts it (`outcome.HeldVerdicts`), so a hung worker is still shut out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import pytest
from aiohttp import web

from gateway.breaker import CircuitBreaker
from gateway.config.pool import BreakerConfig, TimeoutsConfig
from gateway.failure import Stage, failure_of, worker_status
from gateway.outcome import HeldVerdicts
from gateway.upstream import UpstreamTimeout
from gateway.worker import Worker
from tests.gateway.chat_rig import (
    ChatRig,
    chat_answer,
    is_prefill_leg,
    prefilled,
    round_robin_gateway,
    served,
)
from tests.support.transports import TRANSPORTS, through
from tests.support.wait import wait_until

SECRET = b"k"
NAMES = ("a", "b", "c", "d")
HANG = 0  # a `status` for a worker that never answers: an engine stuck behind a live HTTP server
# A request with this many `max_tokens` takes every worker longer than `READ_S`: a long generation,
# whose non-streamed answer (like vLLM's) is sent only once it is whole.
LONG_TOKENS = 20_000
READ_S = 0.5
KEYS = {"t": "sk", "u": "sk-u"}


@dataclass
class Workers:
    """Scripted workers: `status[name]` is what worker `name` answers every completion with
    (`HANG`: nothing, ever); a request for `LONG_TOKENS` or more gets nothing either (a stream
    gets its head). Silent handlers end when `released` is set, as the rig stops."""

    status: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NAMES, 200))
    posts: list[str] = field(default_factory=list)
    silent: list[str] = field(default_factory=list)  # the workers that kept a request unanswered
    health_hangs: set[str] = field(default_factory=set)  # workers whose `/health` never answers
    released: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Rig(ChatRig):
    workers: Workers

    async def chat(
        self, model: str, stream: bool = False, *, tenant: str = "t", max_tokens: int = 4
    ) -> httpx.Response:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "stream": stream,
            "max_tokens": max_tokens,
        }
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}
        )

    def failures(self, pool: str) -> dict[str, int]:
        return {name: self.worker(pool, name).breaker.failures for name in NAMES if self._in(pool, name)}

    def all_closed(self, pool: str) -> bool:
        return all(self.worker(pool, name).breaker.closed for name in NAMES if self._in(pool, name))

    def _in(self, pool: str, name: str) -> bool:
        return any(w.url == self.urls[name] for w in self.state.registry.pools[pool].workers.values())


def _answer(status: int, stream: bool) -> web.Response:
    if status != 200:
        return web.json_response({"error": {"message": "worker says no"}}, status=status)
    return chat_answer(stream)


async def _silent(request: web.Request, stream: bool, released: asyncio.Event) -> web.StreamResponse:
    if not stream:
        await released.wait()
        return web.Response(status=204)
    head = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await head.prepare(request)  # a stream's head comes at once, its first event never
    await released.wait()
    return head


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    workers = Workers()

    def app_for(name: str) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            if name in workers.health_hangs:
                await workers.released.wait()
            return web.Response(text="ok")

        async def chat(request: web.Request) -> web.StreamResponse:
            workers.posts.append(name)
            body: dict[str, Any] = await request.json()
            stream = body.get("stream") is True
            if is_prefill_leg(body):
                return prefilled()
            if workers.status[name] == HANG or body.get("max_tokens", 0) >= LONG_TOKENS:
                workers.silent.append(name)
                return await _silent(request, stream, workers.released)
            return _answer(workers.status[name], stream)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/chat/completions", chat)
        return app

    async with served(NAMES, app_for) as urls:
        # Opens at the first failure counted: any wrong verdict shows as an open breaker.
        breaker = {"failure_threshold": 1, "cooldown_s": 3600}
        every = [urls[name] for name in NAMES]
        timed = {"timeouts": {"read_s": READ_S}, "retry_attempts": 2, "breaker": breaker}
        pools = [
            {
                "name": "three",
                "models": ["m3"],
                "workers": every[:3],
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
            {"name": "slow3", "models": ["s3"], "workers": every[:3], **timed},
            {
                "name": "slow1",
                "models": ["s1"],
                "workers": every[:1],
                **timed,
                "health": {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2},
            },
            {
                "name": "hung3",
                "models": ["h3"],
                "workers": every[:3],
                **timed,
                "breaker": {"failure_threshold": 2, "cooldown_s": 3600},
            },
            {
                "name": "pd",
                "models": ["pd"],
                "prefill_workers": every[:1],
                "decode_workers": every[1:3],
                "workers": every[3:],
                "pd": {"protocol": "vllm", "conditional": False},  # a pair whenever one is free
                **timed,
            },
        ]
        try:
            async with round_robin_gateway(pools, KEYS, SECRET) as gw:
                yield Rig(gw.client, gw.state, urls, workers)
        finally:
            workers.released.set()


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
    assert rig.failures("three") == dict.fromkeys("abc", 0)
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
    assert rig.failures("three") == dict.fromkeys("abc", 0)


async def test_a_5xx_of_the_pools_only_worker_counts_against_it_no_more(rig: Rig) -> None:
    # Nothing to compare with, and nowhere else to send: an open breaker would only turn one
    # tenant's failing requests into every tenant's 503 (tests/gateway/test_worker_5xx_said.py).
    rig.workers.status["a"] = 500
    assert (await rig.chat("m1")).status_code == 502
    assert rig.failures("one") == {"a": 0} and rig.all_closed("one")


@pytest.mark.parametrize(("transport", "stream"), [("lean", False), ("aiohttp", False), ("lean", True)])
async def test_a_request_every_worker_is_too_slow_for_opens_no_breaker(
    rig: Rig, transport: str, stream: bool
) -> None:
    through(rig.state, transport)
    for _ in range(2):  # a tenant's long generations: no worker answers them within `read_s`
        resp = await rig.chat("s3", stream, max_tokens=LONG_TOKENS)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
        assert resp.headers["x-should-retry"] == "false"
    # Each went to a second worker after its first read timeout, and to no third.
    assert len(rig.workers.silent) == 4
    assert rig.failures("slow3") == dict.fromkeys("abc", 0) and rig.all_closed("slow3")
    resp = await rig.chat("s3", stream, tenant="u")  # the pool still serves everyone else
    assert resp.status_code == 200


async def test_a_lone_read_timeout_counts_against_no_worker(rig: Rig) -> None:
    # Nothing to compare with: the request may be what is slow.
    resp = await rig.chat("s1", max_tokens=LONG_TOKENS)
    assert resp.status_code == 504
    assert rig.failures("slow1") == {"a": 0} and rig.all_closed("slow1")
    assert (await rig.chat("s1", tenant="u")).status_code == 200


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_hung_worker_whose_requests_others_answer_is_shut_out(
    rig: Rig, transport: str, stream: bool
) -> None:
    through(rig.state, transport)
    rig.workers.status["a"] = HANG  # it still passes its health checks
    hung = rig.worker("hung3", "a")
    for _ in range(12):  # round-robin: every third request or so starts at `a`
        assert (await rig.chat("h3", stream)).status_code == 200
        if not hung.breaker.closed:
            break
    # Its two timeouts (the breaker's threshold) counted once other workers served the requests.
    assert rig.workers.silent == ["a", "a"]
    assert rig.failures("hung3") == {"a": 2, "b": 0, "c": 0} and not hung.breaker.closed
    for _ in range(3):
        assert (await rig.chat("h3", stream)).status_code == 200
    assert rig.workers.silent == ["a", "a"]


async def test_health_checks_still_take_a_hung_worker_down(rig: Rig) -> None:
    rig.workers.status["a"] = HANG
    assert (await rig.chat("s1")).status_code == 504  # a lone timeout: no breaker verdict
    lone = rig.worker("slow1", "a")
    assert lone.breaker.closed
    rig.workers.health_hangs.add("a")  # hung all through: its health checks time out too
    await wait_until(lambda: not lone.healthy, what="the health checks took the hung worker down")
    resp = await rig.chat("s1")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker_available"
    assert rig.workers.silent == ["a"]


async def test_a_pd_request_every_worker_is_too_slow_for_opens_no_breaker(rig: Rig) -> None:
    # The decode leg times out, the request is recomputed alone on another worker and times out
    # there too; a third worker (`d` or the other decode worker) is not tried.
    resp = await rig.chat("pd", max_tokens=LONG_TOKENS)
    assert resp.status_code == 504
    assert len(rig.workers.silent) == 2 and "a" not in rig.workers.silent
    assert rig.failures("pd") == dict.fromkeys(NAMES, 0) and rig.all_closed("pd")
    assert (await rig.chat("pd", tenant="u")).status_code == 200


def test_a_lone_read_timeout_or_5xx_is_acquitted() -> None:
    @dataclass
    class _Held:
        breaker: CircuitBreaker
        role: str | None = None
        healthy: bool = True

    timeouts = TimeoutsConfig(read_s=1.0)
    timed_out = failure_of(UpstreamTimeout("worker timed out", answered=False), Stage.HEAD, timeouts)
    assert timed_out.held and worker_status(500).held
    # A worker that stalls in the middle of its answer is judged at once, as before.
    stalled = UpstreamTimeout("worker timed out", answered=True)
    assert not failure_of(stalled, Stage.HEAD, timeouts).held
    for held, failures in (
        ([timed_out], 0),
        ([worker_status(500)], 0),
        ([worker_status(500), timed_out], 0),
        ([timed_out, timed_out], 0),
    ):
        workers = [_Held(CircuitBreaker(BreakerConfig(failure_threshold=3))) for _ in held]
        verdicts = HeldVerdicts([])
        for worker in workers:
            verdicts.hold(cast(Worker, worker))
        verdicts.acquit()  # the request ends with no worker's answer
        assert [w.breaker.failures for w in workers] == [failures] * len(held)
    verdicts.hold(cast(Worker, workers[0]))
    verdicts.convict(100.0)  # another worker served the request: the timeout was the worker's
    assert workers[0].breaker.failures == 1


def test_a_held_verdict_never_touches_a_breaker_that_left_the_closed_state() -> None:
    @dataclass
    class _Held:
        breaker: CircuitBreaker

    now_s = 100.0
    opened = _Held(CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=5)))
    verdicts, others = HeldVerdicts([]), HeldVerdicts([])
    verdicts.hold(cast(Worker, opened))
    others.hold(cast(Worker, opened))
    opened.breaker.on_failure(now_s, trial=None)  # other requests open it meanwhile ...
    now_s += 10
    assert opened.breaker.allows(now_s)
    trial = opened.breaker.on_dispatch(now_s)  # ... and another request is its half-open trial
    verdicts.acquit()  # the held request's end frees nobody's trial
    assert not opened.breaker.allows(now_s)
    others.convict(now_s)  # nor reopens it on evidence older than the trial
    opened.breaker.on_success(trial=trial)
    assert opened.breaker.closed and opened.breaker.failures == 0
