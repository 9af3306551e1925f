"""An answer that outlasts `timeouts.total_s` while its worker keeps sending counts against no
worker: how long an answer takes is what the request asked for (`max_tokens`), so counted, one
tenant's long streams opened a pool's breakers one after another, for every tenant. A worker
silent past `read_s` is still the worker's failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import orjson
import pytest
from aiohttp import web

from tests.gateway.chat_rig import ChatRig, chat_answer, chat_app, round_robin_gateway, served

SECRET = b"k"
KEYS = {"t": "sk", "u": "sk-u"}
THRESHOLD = 3
TOTAL_S = 0.4
# The scripted generation: one token every `TOKEN_S` for as long as the client reads, a stream
# the gateway cuts at `TOTAL_S` (the scripted length of a long answer, not a wait of the test's).
TOKEN_S = 0.02
CHUNK = orjson.dumps(
    {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "t"}}]}
)


@dataclass
class Posts:
    names: list[str] = field(default_factory=list)


@dataclass
class Rig(ChatRig):
    posts: Posts

    async def chat(self, prompt: str, tenant: str = "t") -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}
        )


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    posts = Posts()

    def app_for(name: str) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            prompt = (await request.json())["messages"][0]["content"]
            posts.names.append(name)
            if prompt != "long":
                return chat_answer(True, "ok")
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(round(30 / TOKEN_S)):  # bounded: the gateway cuts it long before
                await resp.write(b"data: " + CHUNK + b"\n\n")
                await asyncio.sleep(TOKEN_S)
            return resp

        return chat_app(chat)

    async with served(("a", "b"), app_for) as urls:
        pool = {
            "name": "two",
            "models": ["m"],
            "workers": [urls["a"], urls["b"]],
            "breaker": {"failure_threshold": THRESHOLD, "cooldown_s": 3600},
            "health": {"interval_s": 3600},
            "timeouts": {"total_s": TOTAL_S},
        }
        async with round_robin_gateway([pool], KEYS, SECRET) as gw:
            yield Rig(gw.client, gw.state, urls, posts)


async def test_answers_cut_at_the_total_timeout_open_no_breaker(rig: Rig) -> None:
    for _ in range(2 * THRESHOLD):  # round robin: THRESHOLD on each worker
        resp = await rig.chat("long")
        assert resp.status_code == 200  # the stream had begun: its last event says why it ended
        error = orjson.loads(resp.content.split(b"\n\n")[-3].removeprefix(b"data: "))["error"]
        assert "took longer than the gateway's limit" in error["message"]
    assert sorted(rig.posts.names) == ["a"] * THRESHOLD + ["b"] * THRESHOLD  # no retry either
    assert {name: rig.worker("two", name).breaker.failures for name in "ab"} == {"a": 0, "b": 0}
    rig.posts.names.clear()
    for _ in range(4):
        assert (await rig.chat("hi", tenant="u")).status_code == 200
    assert sorted(rig.posts.names) == ["a", "a", "b", "b"]
