"""Workers and DNS answers for the tests of workers coming and going through a running gateway.

`start_worker` serves `/health` (answered 200 while `healthy` is set) and chat completions (held
while `hold` is clear); `scripted_dns` answers a DNS name through the loop's own `getaddrinfo`,
the call the real resolver (`gateway.worker_sources.resolve_with_loop`) makes."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from tests.support.inprocess import InProcessGateway
from tests.support.loopback import serve_app

SERVICE = "vllm-headless.llm.svc.cluster.local"
API_KEY = "sk-t"
SECRET = b"k"


@dataclass
class ScriptedDns:
    """The loop's `getaddrinfo` for `SERVICE`: the current answer, or the error it raises."""

    answer: list[str] | OSError
    lookups: int = 0

    async def __call__(self, host: str, port: int) -> list[tuple[Any, ...]]:
        self.lookups += 1
        answer = self.answer
        if isinstance(answer, OSError):
            raise answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answer]


def scripted_dns(monkeypatch: pytest.MonkeyPatch, answer: list[str] | OSError) -> ScriptedDns:
    """Make the running loop answer `SERVICE` from a script; other names resolve as before."""
    scripted = ScriptedDns(answer)
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: Any, port: Any, **kw: Any) -> Any:
        if host == SERVICE:
            return await scripted(host, port)
        return await real(host, port, **kw)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return scripted


@dataclass
class Worker:
    """A worker on 127.0.0.1: what it served, and switches for its health and its answers."""

    runner: web.AppRunner
    port: int
    served: list[str] = field(default_factory=list)
    arrived: list[str] = field(default_factory=list)
    healthy: asyncio.Event = field(default_factory=asyncio.Event)
    hold: asyncio.Event = field(default_factory=asyncio.Event)
    metrics: str = ""  # the /metrics page (none: 404)
    scrapes: int = 0  # GET /metrics answered

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_worker() -> Worker:
    worker: Worker

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok", status=200 if worker.healthy.is_set() else 503)

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        text = body["messages"][-1]["content"][:16]
        worker.arrived.append(text)
        await worker.hold.wait()
        worker.served.append(text)
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41},
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        worker.scrapes += 1
        return web.Response(text=worker.metrics) if worker.metrics else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    worker = Worker(runner, port)
    worker.healthy.set()
    worker.hold.set()
    return worker


def gateway_config(pool: dict[str, Any]) -> dict[str, Any]:
    """One pool `p` serving model `m` (plus `pool`'s workers and settings), one tenant."""
    return {
        "pools": [{"name": "p", "models": ["m"], "health": {"interval_s": 0.1}, **pool}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, API_KEY)]}],
        "scrape": {"enabled": False},
    }


async def chat(gw: InProcessGateway, text: str) -> tuple[int, dict[str, Any]]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    resp = await gw.client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    return resp.status_code, resp.json()
