"""The in-process request path against one scripted upstream (`request_rig`), for the
request-path tests: a policy that picks the first healthy worker, and an upstream whose status,
error body, pauses and gate the test sets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from aiohttp import web

from gateway.app import GatewayApp
from gateway.auth import hash_api_key
from gateway.state import GatewayState
from policies.base import Observation, RouteDecision, RouteRequest, WorkerView
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.policies import IgnoresFeedback

SECRET = b"k"


@dataclass
class ScriptedPolicy(IgnoresFeedback):
    """Picks the first healthy worker and claims `shared_blocks` public blocks; records feedback."""

    name: str = "scripted"
    shared_blocks: int = 0
    requests: list[RouteRequest] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        self.requests.append(req)
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        return RouteDecision(healthy[0].worker_id, 0.0, "first", shared_prefix_blocks=self.shared_blocks)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self.observations.append(obs)


@dataclass
class Upstream:
    status: int = 200
    error_body: Any = None
    received: list[dict[str, Any]] = field(default_factory=list)
    peers: set[Any] = field(default_factory=set)  # the gateway's end of each connection used
    # Streams: the pause between chunks, and after [DONE] before the body ends.
    chunk_pause_s: float = 0.0
    tail_pause_s: float = 0.0
    garbage: bytes | None = None  # answer 200 with this instead of a completion (or its chunks)
    gate: asyncio.Event | None = None  # streams wait for it before their first chunk


@dataclass
class Rig:
    client: httpx.AsyncClient
    upstream: Upstream
    policy: ScriptedPolicy
    state: GatewayState
    app: GatewayApp

    async def chat(self, key: str = "sk-strict", **extra: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}", **extra.pop("headers", {})}
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)


@contextlib.asynccontextmanager
async def request_rig(tiny_model: Path) -> AsyncIterator[Rig]:
    """The gateway in process in front of one scripted upstream: pool "p" (models "m" and
    "m-lora") and pool "tok" (model "m-tok", tokenizer mode on `tiny_model`), three tenants."""
    upstream = Upstream()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        upstream.received.append({"request_id": request.headers.get("x-request-id"), "body": body})
        if request.transport is not None:
            upstream.peers.add(request.transport.get_extra_info("peername"))
        if upstream.status != 200:
            if isinstance(upstream.error_body, bytes):
                return web.Response(body=upstream.error_body, status=upstream.status)
            error = upstream.error_body if upstream.error_body is not None else {"error": {"message": "no"}}
            return web.json_response(error, status=upstream.status)
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            if upstream.garbage is not None:
                return web.Response(body=upstream.garbage, content_type="application/json")
            return web.json_response({"choices": [], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if upstream.garbage is not None:
            await resp.write(b"data: " + upstream.garbage + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if upstream.gate is not None:
            await upstream.gate.wait()
        for word in ("a", "b", "c"):
            delta = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            await resp.write(b"data: " + orjson.dumps(delta) + b"\n\n")
            await asyncio.sleep(upstream.chunk_pause_s)
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(upstream.tail_pause_s)
        await resp.write_eof()
        return resp

    server = web.Application()
    server.router.add_get("/health", health)
    server.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(server)

    def tenant(name: str, isolation: str) -> dict[str, Any]:
        return {"name": name, "api_key_hashes": [hash_api_key(SECRET, f"sk-{name}")], "isolation": isolation}

    config = {
        "pools": [
            {
                "name": "p",
                "models": ["m", "m-lora"],
                "adapters": {"m-lora": "sql-lora"},
                "workers": [f"http://127.0.0.1:{port}"],
                "retry_attempts": 0,
                "identity": {"weights_version": "w1", "epoch": 3},
            },
            {
                "name": "tok",
                "models": ["m-tok"],
                "workers": [f"http://127.0.0.1:{port}"],
                "normalizer": {"mode": "tokenizer", "tokenizer_dir": str(tiny_model)},
            },
        ],
        "tenants": [
            tenant("strict", "strict"),
            tenant("shared", "shared_public"),
            tenant("pub", "public"),
        ],
        "scrape": {"enabled": False},
    }
    policy = ScriptedPolicy()
    try:
        async with gateway_in_process(config, policy, secret=SECRET) as gw:
            yield Rig(gw.client, upstream, policy, gw.state, gw.app)
    finally:
        await runner.cleanup()
