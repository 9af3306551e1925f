"""DNS discovery through a running gateway: a headless Service scaled to zero (cluster DNS answers
NXDOMAIN) empties the pool, whose requests then get the gateway's "no worker" error, and the
workers found again serve."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from policies import make_policy
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_app
from tests.support.wait import wait_until

SERVICE = "vllm-headless.llm.svc.cluster.local"


@dataclass
class ScriptedDns:
    """The loop's `getaddrinfo` for `SERVICE`: the current answer, or the error it raises."""

    answer: list[str] | OSError
    lookups: int = 0

    async def __call__(self, host: str, port: int, **_: object) -> list[tuple[Any, ...]]:
        self.lookups += 1
        answer = self.answer
        if isinstance(answer, OSError):
            raise answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answer]


@dataclass
class Worker:
    """A worker on 127.0.0.1 that answers `/health` and every chat completion."""

    runner: web.AppRunner
    port: int
    served: list[str] = field(default_factory=list)


async def start_worker() -> Worker:
    served: list[str] = []

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        served.append(body["messages"][-1]["content"])
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

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    return Worker(runner, port, served)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await start_worker()
    try:
        yield w
    finally:
        await w.runner.cleanup()


@pytest.fixture
async def dns(monkeypatch: pytest.MonkeyPatch) -> ScriptedDns:
    """Answers for `SERVICE` through the real resolver path (`resolve_with_loop` asks the loop)."""
    scripted = ScriptedDns(["127.0.0.1"])
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: Any, port: Any, **kw: Any) -> Any:
        if host == SERVICE:
            return await scripted(host, port, **kw)
        return await real(host, port, **kw)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return scripted


def dns_config(port: int) -> dict[str, Any]:
    pool = {
        "name": "p",
        "models": ["m"],
        "dns": {"name": SERVICE, "port": port, "refresh_s": 0.05},
        "health": {"interval_s": 0.1},
    }
    return {
        "pools": [pool],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk-t")]}],
        "scrape": {"enabled": False},
    }


async def chat(gw: InProcessGateway, text: str) -> tuple[int, dict[str, Any]]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    resp = await gw.client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-t"})
    return resp.status_code, resp.json()


async def test_a_service_scaled_to_zero_answers_no_worker_then_serves_again(
    worker: Worker, dns: ScriptedDns
) -> None:
    async with gateway_in_process(dns_config(worker.port), make_policy("round_robin"), secret=b"k") as gw:
        pool = gw.state.registry.pools["p"]
        assert (await chat(gw, "before"))[0] == 200 and worker.served == ["before"]
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        await wait_until(lambda: not pool.workers, what="the pool is empty")
        status, body = await chat(gw, "during")
        assert status == 503 and body["error"]["code"] == "no_worker_available"
        assert body["error"]["message"] == "no healthy worker available for model 'm'"
        assert worker.served == ["before"]
        text = gw.state.routing.metrics.render().decode()
        assert 'kvgate_discovery_workers{pool="p"} 0.0' in text
        assert 'kvgate_discovery_errors_total{pool="p",reason="no_addresses"} 1.0' in text
        dns.answer = ["127.0.0.1"]
        await wait_until(lambda: any(w.healthy for w in pool.workers.values()), what="the worker is back")
        assert (await chat(gw, "after"))[0] == 200 and worker.served == ["before", "after"]


async def test_a_dns_outage_keeps_the_workers(worker: Worker, dns: ScriptedDns) -> None:
    async with gateway_in_process(dns_config(worker.port), make_policy("round_robin"), secret=b"k") as gw:
        pool = gw.state.registry.pools["p"]
        dns.answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        seen = dns.lookups
        await wait_until(lambda: dns.lookups >= seen + 5, what="five failed lookups")
        assert len(pool.workers) == 1
        assert (await chat(gw, "still"))[0] == 200 and worker.served == ["still"]
