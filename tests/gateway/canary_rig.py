"""The breaker canaries' rig: scripted workers (a chat route, the canary's `/v1/completions`,
`/tokenize`) served on 127.0.0.1, and a gateway in process routing round robin over them
(`gateway/canary.py`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.canary import CANARY_PROMPT, Canaries, CanaryVerdict
from gateway.gauges import refresh_gauges
from tests.gateway.chat_rig import ChatRig, chat_answer, chat_app, round_robin_gateway, served
from tests.support.wait import wait_until

SECRET = b"k"
KEYS = {"t": "sk", "u": "sk-u"}
POISON = "poison"  # a prompt every worker fails with a 500 (vLLM's GenerationError for one input)
FAILED = {"error": {"message": "GenerationError", "type": "InternalServerError", "code": 500}}
FIRST_CHUNK = {
    "id": "x",
    "object": "chat.completion.chunk",
    "choices": [{"index": 0, "delta": {"content": "p"}}],
}
COMPLETION_CHUNK = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "OK"}]}
# Long enough for a canary to wait for anything the test does meanwhile; the waits are bounded.
WAIT_S = 30.0


@dataclass
class Workers:
    """Scripted workers. `broken`: 500 to every generation (chats and canaries alike);
    `stream_errors`: every stream ends, after its first event, with the worker's own error event;
    `POISON` gets a 500 from any worker. `held`: canaries wait for `release` before answering;
    `refusal`: every canary gets this status (`busy_event`: as the code of the worker's own error
    event, the first of a 200 stream, as SGLang streams a full queue); `whole`: every canary
    gets this whole 200 answer (body, content type) instead of a stream; `chat_refusal`: every
    chat gets this status. `drops`: the worker closes a canary's connection before answering,
    `"reused"` only a kept-alive one (as uvicorn closes an idle connection just as a request
    arrives on it: the worker never saw the request), `"all"` every one (`dropped` counts them).
    `chat_holds`: a chat whose prompt is a key waits for that event before answering."""

    posts: list[str] = field(default_factory=list)
    canaries: list[str] = field(default_factory=list)
    canary_heads: list[tuple[str | None, str | None]] = field(default_factory=list)  # id, User-Agent
    broken: set[str] = field(default_factory=set)
    stream_errors: set[str] = field(default_factory=set)
    held: bool = False
    refusal: int | None = None
    busy_event: bool = False
    whole: tuple[bytes, str] | None = None  # every canary's answer: a whole body and its type
    chat_refusal: int | None = None
    stream_error_code: int = 500  # the code of the error event that ends a stream (`stream_errors`)
    drops: str | None = None  # "reused" or "all": canary connections closed before any answer
    chat_holds: dict[str, asyncio.Event] = field(default_factory=dict)  # prompt → its release
    dropped: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    most_in_flight: int = 0


def _stream(events: list[bytes]) -> web.Response:
    body = b"".join(b"data: " + data + b"\n\n" for data in events)
    return web.Response(body=body, content_type="text/event-stream")


def app_for(workers: Workers, name: str) -> web.Application:
    connections: list[object] = []  # each connection a canary came on (kept: ids are not reused)

    async def chat(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        workers.posts.append(name)
        hold = workers.chat_holds.get(body["messages"][0]["content"])
        if hold is not None:
            await hold.wait()
        if name in workers.broken or body["messages"][0]["content"] == POISON:
            return web.json_response(FAILED, status=500)
        if workers.chat_refusal is not None:
            return web.json_response(FAILED, status=workers.chat_refusal)
        stream = body.get("stream") is True
        if stream and name in workers.stream_errors:
            error = {"error": {**FAILED["error"], "code": workers.stream_error_code}}
            return _stream([orjson.dumps(FIRST_CHUNK), orjson.dumps(error), b"[DONE]"])
        return chat_answer(stream, "ok")

    async def completions(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        reused = any(seen is transport for seen in connections)
        connections.append(transport)
        if transport is not None and (workers.drops == "all" or (workers.drops == "reused" and reused)):
            workers.dropped += 1
            transport.abort()  # closed before any byte of an answer
            raise web.HTTPInternalServerError  # never written: the connection is gone
        body: dict[str, Any] = await request.json()
        # The canary is the gateway's own: its fixed prompt, one token, streamed.
        assert (body["prompt"], body["max_tokens"], body["stream"]) == (CANARY_PROMPT, 1, True)
        workers.canaries.append(name)
        workers.canary_heads.append((request.headers.get("x-request-id"), request.headers.get("user-agent")))
        workers.in_flight += 1
        workers.most_in_flight = max(workers.most_in_flight, workers.in_flight)
        try:
            if workers.held:
                await workers.release.wait()
            if workers.refusal is not None:
                refused = {"error": {"message": "The request queue is full.", "code": workers.refusal}}
                if workers.busy_event:
                    return _stream([orjson.dumps(refused), b"[DONE]"])
                return web.json_response(refused, status=workers.refusal)
            if workers.whole is not None:
                answer, content_type = workers.whole
                return web.Response(body=answer, headers={"content-type": content_type})
            if name in workers.broken:
                return web.json_response(FAILED, status=500)
            if name in workers.stream_errors:
                return _stream([orjson.dumps(COMPLETION_CHUNK), orjson.dumps(FAILED), b"[DONE]"])
            return _stream([orjson.dumps(COMPLETION_CHUNK), b"[DONE]"])
        finally:
            workers.in_flight -= 1

    async def tokenize(_: web.Request) -> web.Response:
        # No engine needed: a worker failing every generation still answers it.
        return web.json_response({"count": 2, "max_model_len": 4096, "tokens": [1, 2]})

    app = chat_app(chat, completions)
    app.router.add_post("/tokenize", tokenize)
    return app


@dataclass
class Rig(ChatRig):
    workers: Workers

    async def chat(self, prompt: str = "hi", *, tenant: str = "t", stream: bool = False) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}
        )

    @property
    def canaries(self) -> Canaries:
        assert self.state.canaries is not None
        return self.state.canaries

    async def tokenize(self) -> httpx.Response:
        body = {"model": "m", "prompt": "x"}
        return await self.client.post(
            "/tokenize", json=body, headers={"authorization": f"Bearer {KEYS['t']}"}
        )

    async def canaries_ended(self, verdict: CanaryVerdict, n: int) -> None:
        """Wait until `n` canaries in all have ended with `verdict`."""
        counts = self.canaries.counts
        await wait_until(lambda: counts[verdict] >= n, timeout_s=WAIT_S, what=f"{n} {verdict} canaries")

    async def canaries_passed(self, n: int) -> None:
        """Wait until `n` canaries have passed in all, and none is in flight."""
        counts = self.canaries.counts
        await wait_until(lambda: counts[CanaryVerdict.PASSED] >= n, timeout_s=WAIT_S)
        await wait_until(lambda: self.canaries.in_flight == 0, timeout_s=WAIT_S)

    def canary_series(self) -> dict[tuple[str, str], float]:
        """`kvgate_breaker_canaries_total` as scraped: (worker name, verdict) → count."""
        names = {url: name for name, url in self.urls.items()}
        refresh_gauges(self.state)  # as GET /metrics does
        page = self.state.routing.metrics.render().decode()
        return {
            (names[s.labels["worker"]], s.labels["verdict"]): s.value
            for f in text_string_to_metric_families(page)
            for s in f.samples
            if s.name == "kvgate_breaker_canaries_total" and s.labels["pool"] == "p"
        }

    def failures(self, names: str) -> dict[str, int]:
        return {name: self.worker("p", name).breaker.failures for name in names}

    def closed(self, name: str) -> bool:
        return self.worker("p", name).breaker.closed


@contextlib.asynccontextmanager
async def gateway(names: str = "ab", **pool: Any) -> AsyncIterator[Rig]:
    """A gateway routing round robin over scripted workers `names` in one pool `p` (model `m`);
    `pool` overrides its config. Health checks only at the start: every worker stays healthy, so
    only breakers decide."""
    workers = Workers()
    try:
        async with served(names, lambda name: app_for(workers, name), handler_cancellation=True) as urls:
            config = {
                "name": "p",
                "models": ["m"],
                "workers": [urls[n] for n in names],
                "health": {"interval_s": 3600},
                **pool,
            }
            async with round_robin_gateway([config], KEYS, SECRET) as gw:
                try:
                    yield Rig(gw.client, gw.state, urls, workers)
                finally:
                    _let_go(workers)  # before the gateway waits for its requests in flight
    finally:
        _let_go(workers)


def _let_go(workers: Workers) -> None:
    """Answer every held canary and chat."""
    workers.release.set()
    for hold in workers.chat_holds.values():
        hold.set()
