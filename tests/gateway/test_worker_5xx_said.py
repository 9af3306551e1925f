"""A worker's 5xx that no other worker fixed: the client reads the worker's own message, and the
5xx never opens the breaker of a pool's last routable worker (of its role), so one tenant's
requests that the worker fails (vLLM answers 500 for a request it failed on) cannot take the model
away from every tenant (`failure.worker_said`, `outcome.HeldVerdicts`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.errors import withhold_salts
from gateway.failure import WORKER_SAID_CHARS, worker_said, worker_status
from tests.gateway.access_lines import capture_access
from tests.gateway.chat_rig import (
    ChatRig,
    chat_answer,
    chat_app,
    is_prefill_leg,
    prefilled,
    round_robin_gateway,
    served,
)
from tests.support.transports import TRANSPORTS, through

SECRET = b"k"
KEYS = {"t": "sk", "u": "sk-u"}
NAMES = ("a", "b", "p", "c")
POISON = "poison"  # a prompt every worker fails on: vLLM's GenerationError, say
SAID = "GenerationError: the engine failed while generating this request"


@dataclass
class Workers:
    """Scripted workers: a prompt of `POISON` gets a 500 whose body is `error_body` (vLLM's
    shape by default, quoting the request's `cache_salt`); anything else is served."""

    error_body: bytes | None = None  # None: vLLM's error, with the salt the worker was sent
    salt_at: int | None = None  # the salt this far into the message, after that many `x`
    stall_error_body: bool = False  # send the 500's head and never its body
    posts: list[str] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Rig(ChatRig):
    workers: Workers

    async def chat(
        self, model: str, prompt: str = "hi", *, stream: bool = False, tenant: str = "t"
    ) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}
        )

    async def models(self) -> list[str]:
        resp = await self.client.get("/v1/models", headers={"authorization": f"Bearer {KEYS['u']}"})
        return [card["id"] for card in resp.json()["data"]]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    workers = Workers()

    def app_for(name: str) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            workers.posts.append(name)
            body: dict[str, Any] = await request.json()
            if is_prefill_leg(body):
                return prefilled()
            if body["messages"][0]["content"] != POISON:
                return chat_answer(body.get("stream") is True, "ok")
            if workers.stall_error_body:
                head = web.StreamResponse(status=500, headers={"content-type": "application/json"})
                await head.prepare(request)
                await workers.released.wait()
                return head
            error = workers.error_body
            if error is None and workers.salt_at is not None:
                message = "x" * workers.salt_at + f"{body.get('cache_salt')} trailing"
                error = orjson.dumps({"error": {"message": message, "code": 500}})
            if error is None:
                message = f"{SAID} (cache_salt={body.get('cache_salt')})"
                error = orjson.dumps(
                    {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
                )
            return web.Response(body=error, status=500, content_type="application/json")

        return chat_app(chat)

    async with served(NAMES, app_for) as urls:
        # Opens at the first failure counted: any wrong verdict shows as an open breaker. Health
        # checks only at the start: a test's own verdict on a worker's health stands.
        common = {
            "retry_attempts": 2,
            "breaker": {"failure_threshold": 1, "cooldown_s": 3600},
            "health": {"interval_s": 3600},
        }
        pools = [
            {"name": "one", "models": ["m1"], "workers": [urls["a"]], **common},
            {"name": "two", "models": ["m2"], "workers": [urls["a"], urls["b"]], **common},
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
            async with round_robin_gateway(pools, KEYS, SECRET) as gw:
                yield Rig(gw.client, gw.state, urls, workers)
        finally:
            workers.released.set()


def _said_prefix(resp: httpx.Response) -> str:
    error = resp.json()["error"]
    assert resp.status_code == 502 and error["code"] == "bad_gateway" and error["type"] == "server_error"
    message: str = error["message"]
    return message


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_lone_workers_5xx_leaves_the_model_to_every_tenant(
    rig: Rig, transport: str, stream: bool
) -> None:
    through(rig.state, transport)
    lines = capture_access(rig.state)
    for _ in range(3):  # one tenant's requests that the pool's only worker fails
        resp = await rig.chat("m1", POISON, stream=stream)
        message = _said_prefix(resp)
        # The worker's own words reach the client, less the salt the gateway sent it ...
        assert message.startswith(f"worker answered 500: {SAID} (cache_salt=")
        assert "[salt withheld]" in message
        # ... and never the logs.
        assert lines.of(resp.headers["x-request-id"])["error_detail"] == "worker answered 500"
    lone = rig.worker("one", "a")
    assert lone.breaker.closed and lone.breaker.failures == 0
    assert "m1" in await rig.models()
    assert (await rig.chat("m1", tenant="u", stream=stream)).status_code == 200


@pytest.mark.parametrize("how", ["breaker_open", "unhealthy"])
async def test_a_5xx_spares_the_last_routable_worker_of_two(rig: Rig, how: str) -> None:
    down = rig.worker("two", "b")
    if how == "breaker_open":
        down.breaker.on_failure(time.monotonic(), trial=None)  # threshold 1: open for the whole test
    else:
        down.healthy = False
    for _ in range(3):
        assert (await rig.chat("m2", POISON)).status_code == 502
    assert rig.workers.posts == ["a"] * 3
    last = rig.worker("two", "a")
    assert last.breaker.closed and last.breaker.failures == 0
    assert (await rig.chat("m2", tenant="u")).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pd_pools_last_decode_worker_is_spared(rig: Rig, stream: bool) -> None:
    for _ in range(3):
        resp = await rig.chat("pd", POISON, stream=stream)
        assert _said_prefix(resp).startswith(f"worker answered 500: {SAID}")
    assert "c" in rig.workers.posts
    for name in ("p", "c"):
        assert rig.worker("pd", name).breaker.closed
    assert (await rig.chat("pd", tenant="u", stream=stream)).status_code == 200


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("body", "said"),
    [
        (orjson.dumps({"object": "error", "message": "old shape", "code": 500}), "old shape"),
        (orjson.dumps({"error": {"message": "x" * 5000}}), None),  # longer than the prefix read
        (b"<html>Internal Server Error</html>", None),
        (orjson.dumps({"error": {"message": "  "}}), None),
    ],
)
async def test_the_workers_message_in_each_shape(
    rig: Rig, transport: str, body: bytes, said: str | None
) -> None:
    through(rig.state, transport)
    rig.workers.error_body = body
    for stream in (False, True):
        message = _said_prefix(await rig.chat("m1", POISON, stream=stream))
        assert message == ("worker answered 500" if said is None else f"worker answered 500: {said}")


@pytest.mark.parametrize(("transport", "stream"), [("lean", True), ("aiohttp", False), ("aiohttp", True)])
async def test_an_error_body_that_never_comes_says_nothing(rig: Rig, transport: str, stream: bool) -> None:
    # (The lean client reads a whole answer in one call, its error body too, within `read_s`.)
    through(rig.state, transport)
    rig.workers.stall_error_body = True
    assert _said_prefix(await rig.chat("m1", POISON, stream=stream)) == "worker answered 500"


@pytest.mark.parametrize("at", [500, 504, 506, 510, 511])
async def test_a_salt_across_the_cut_is_withheld_whole(rig: Rig, at: int) -> None:
    """Salts are withheld before the message is cut: cut first, a salt 506 characters in kept its
    first 6 characters, fewer than a quote must keep to be withheld (`errors.MIN_SALT_RUN`)."""
    rig.workers.salt_at = at
    for stream in (False, True):
        message = _said_prefix(await rig.chat("m1", POISON, stream=stream))
        said = ("x" * at + "[salt withheld] trailing")[:WORKER_SAID_CHARS] + "..."
        assert message == f"worker answered 500: {said}"


def test_worker_said_withholds_salts_before_it_cuts() -> None:
    salt = "0123456789abcdef0123456789abcdef"
    for at in range(WORKER_SAID_CHARS - 40, WORKER_SAID_CHARS + 1):
        body = orjson.dumps({"error": {"message": "x" * at + salt + " trailing"}})
        said = worker_said(body, lambda text: withhold_salts(text, [salt]))
        assert said is not None and "x" * (at - 1) + salt[:1] not in said, at


def test_worker_said_cuts_long_messages_and_keeps_503s_words() -> None:
    long = orjson.dumps({"error": {"message": "y" * 3000}})
    said = worker_said(long, lambda text: text)
    assert said == "y" * WORKER_SAID_CHARS + "..."
    assert worker_status(500, said=said).error().message == f"worker answered 500: {said}"
    assert worker_status(500, said=said).detail() == "worker answered 500"
    assert worker_status(503).error().message == "worker answered 503"
