"""The pools' timeouts: defaults sized for long generations (`read_s` covers a whole non-streamed
answer, `total_s` a long stream), and `first_event_s`, which finds a hung worker for a stream well
before `read_s` would (docs/gateway.md, "Timeouts")."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.config.pool import TimeoutsConfig
from tests.gateway.chat_rig import (
    ChatRig,
    chat_answer,
    is_prefill_leg,
    prefilled,
    round_robin_gateway,
    served,
)
from tests.support.transports import TRANSPORTS, through

SECRET = b"k"
KEY = "sk"
NAMES = ("a", "b", "p", "c")
FIRST_EVENT_S = 0.3
# Far beyond the test's own bounds: a test that waited for it would fail on its client's timeout.
READ_S = 3600.0


def test_the_defaults_let_long_generations_finish() -> None:
    timeouts = TimeoutsConfig()
    # A non-streamed answer comes only once whole: `read_s` is the longest such generation, the
    # OpenAI SDK's own default timeout.
    assert timeouts.read_s == 600
    # The longest stream; a hung worker's stream is left for another at `first_event_s`.
    assert timeouts.total_s == 3600 and timeouts.first_event_s == 120
    assert timeouts.first_event_s < timeouts.read_s < timeouts.total_s
    assert all(math.isfinite(v) for v in timeouts.model_dump().values())


@dataclass
class Workers:
    """Scripted workers: those in `hung` send a stream's head and never its first event (an engine
    stuck behind a live HTTP server); `slow_s` delays every non-streamed answer (a generation)."""

    hung: set[str] = field(default_factory=set)
    slow_s: float = 0.0
    silent: list[str] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Rig(ChatRig):
    workers: Workers

    async def chat(self, model: str, stream: bool) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": stream}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    workers = Workers()

    def app_for(name: str) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def chat(request: web.Request) -> web.StreamResponse:
            body: dict[str, Any] = await request.json()
            stream = body.get("stream") is True
            if is_prefill_leg(body):
                if name in workers.hung:  # a prefill leg's answer comes once the prompt is prefilled
                    workers.silent.append(name)
                    await workers.released.wait()
                return prefilled()
            if stream and name in workers.hung:
                workers.silent.append(name)
                head = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await head.prepare(request)
                await workers.released.wait()
                return head
            if not stream and workers.slow_s:
                await asyncio.sleep(workers.slow_s)  # the generation's own time, not a wait for a condition
            return chat_answer(stream)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/chat/completions", chat)
        return app

    async with served(NAMES, app_for) as urls:
        common = {
            "timeouts": {"read_s": READ_S, "first_event_s": FIRST_EVENT_S},
            "breaker": {"failure_threshold": 1, "cooldown_s": 3600},
            "health": {"interval_s": 3600},
        }
        pools = [
            {"name": "two", "models": ["m2"], "workers": [urls["a"], urls["b"]], **common},
            {"name": "one", "models": ["m1"], "workers": [urls["a"]], **common},
            {
                "name": "pd",
                "models": ["pd"],
                "prefill_workers": [urls["p"]],
                "decode_workers": [urls["c"]],
                "pd": {"protocol": "vllm", "conditional": False},
                **common,
            },
        ]
        try:
            async with round_robin_gateway(pools, {"t": KEY}, SECRET) as gw:
                yield Rig(gw.client, gw.state, urls, workers)
        finally:
            workers.released.set()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_hung_workers_stream_goes_to_another_at_first_event_s(rig: Rig, transport: str) -> None:
    through(rig.state, transport)
    rig.workers.hung.add("a")
    for _ in range(2):  # round-robin: one of them starts at `a`
        resp = await rig.chat("m2", stream=True)
        assert resp.status_code == 200 and b"[DONE]" in resp.content
    assert rig.workers.silent == ["a"]
    # Another worker served the request: the timeout was `a`'s (threshold 1).
    assert not rig.worker("two", "a").breaker.closed


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_lone_hung_workers_stream_ends_with_504(rig: Rig, transport: str) -> None:
    through(rig.state, transport)
    rig.workers.hung.add("a")
    resp = await rig.chat("m1", stream=True)
    error = resp.json()["error"]
    assert resp.status_code == 504 and error["code"] == "upstream_timeout"
    assert error["message"] == f"worker stream sent no event within {FIRST_EVENT_S:g} s"
    assert rig.worker("one", "a").breaker.closed  # nothing to compare: no verdict


async def test_first_event_s_leaves_whole_answers_alone(rig: Rig) -> None:
    rig.workers.slow_s = FIRST_EVENT_S * 3  # a non-streamed generation longer than `first_event_s`
    resp = await rig.chat("m1", stream=False)
    assert resp.status_code == 200


async def test_a_pd_decode_legs_first_event_is_bounded_too(rig: Rig) -> None:
    rig.workers.hung.add("c")
    resp = await rig.chat("pd", stream=True)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
    assert set(rig.workers.silent) == {"c"}


async def test_a_streamed_requests_prefill_leg_is_bounded_too(rig: Rig) -> None:
    rig.workers.hung.add("p")
    resp = await rig.chat("pd", stream=True)
    # The prefill worker never answered its leg; the decode worker then served the request alone.
    assert resp.status_code == 200 and b"[DONE]" in resp.content
    assert rig.workers.silent == ["p"]
