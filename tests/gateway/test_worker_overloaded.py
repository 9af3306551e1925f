"""A worker's 529 is Anthropic's "overloaded" (and what some servers behind a proxy send when
overloaded): treated as a worker's 503 is. The request goes to another worker; when every worker
tried is overloaded, an Anthropic client gets 529 `overloaded_error` in Anthropic's envelope (its
SDK raises `OverloadedError`), an OpenAI client 503 `worker_overloaded`, both with the workers'
`Retry-After` and free to retry it whatever their call's budget, and the request is counted with
the status its client got. Workers that all answer 529 open no breaker."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import pytest
from aiohttp import web

from policies.baselines import RoundRobin
from tests.support.gateway_config import SECRET, pd_pool, tenant
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_worker

MESSAGES: dict[str, Any] = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
CHAT: dict[str, Any] = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC_KEY = {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}
OPENAI_KEY = {"authorization": "Bearer sk-a"}


@dataclass
class Overloaded:
    """A worker that answers every POST 529 with Anthropic's body and `Retry-After: 2`."""

    posts: list[str] = field(default_factory=list)

    async def answer(self, request: web.Request) -> web.Response:
        self.posts.append(request.path)
        body = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        return web.json_response(body, status=529, headers={"Retry-After": "2"})


@contextlib.asynccontextmanager
async def _gateway(workers: list[Overloaded], *, prefill: int = 0) -> AsyncIterator[InProcessGateway]:
    """A gateway in front of `workers`; with `prefill`, a prefill/decode pool whose first
    `prefill` workers prefill and the others decode."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [
            await serve_worker(stack, {"/v1/messages": w.answer, "/v1/chat/completions": w.answer})
            for w in workers
        ]
        pool: dict[str, Any] = {"name": "p", "models": ["m"], "workers": urls}
        if prefill:
            pool = pd_pool(urls[:prefill], urls[prefill:])
        config = {"pools": [pool], "tenants": [tenant("a", "sk-a")], "scrape": {"enabled": False}}
        async with gateway_in_process(config, RoundRobin(), secret=SECRET) as gw:
            yield gw


def _requests_counted(gw: InProcessGateway, endpoint: str, status: str) -> float:
    text = gw.state.routing.metrics.render().decode()
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("kvgate_requests_total{")
        and f'endpoint="{endpoint}"' in line
        and f'status="{status}"' in line
    ]
    return sum(float(line.split()[-1]) for line in lines)


async def test_overloaded_workers_are_retried_then_told_in_each_apis_own_terms() -> None:
    workers = [Overloaded(), Overloaded()]
    async with _gateway(workers) as gw:
        messages = await gw.client.post("/v1/messages", json=MESSAGES, headers=ANTHROPIC_KEY)
        assert sorted(len(w.posts) for w in workers) == [1, 1]  # the second worker was tried
        assert messages.status_code == 529, messages.text
        assert messages.json()["type"] == "error"
        assert messages.json()["error"]["type"] == "overloaded_error"
        assert messages.headers["retry-after"] == "2"  # the workers' advice
        # Every attempt was told to come back later, having cost no worker anything: the client's
        # own retry is not forbidden, whatever its call's budget.
        assert "x-should-retry" not in messages.headers

        chat = await gw.client.post("/v1/chat/completions", json=CHAT, headers=OPENAI_KEY)
        assert sorted(len(w.posts) for w in workers) == [2, 2]
        assert chat.status_code == 503, chat.text
        error = chat.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "worker_overloaded")
        assert chat.headers["retry-after"] == "2" and "x-should-retry" not in chat.headers

        # Counted as their clients got them.
        assert _requests_counted(gw, "messages", "529") == 1
        assert _requests_counted(gw, "chat", "503") == 1
        # Overload on every worker is no verdict on any of them (as for a 503).
        assert all(
            w.breaker.closed for pool in gw.state.registry.pools.values() for w in pool.workers.values()
        )


async def test_the_anthropic_sdk_reads_an_overloaded_worker_as_overloaded() -> None:
    async with _gateway([Overloaded()]) as gw:
        transport = httpx2.ASGITransport(app=gw.app)
        async with (
            httpx2.AsyncClient(transport=transport, base_url="http://gw") as http,
            anthropic.AsyncAnthropic(
                api_key="sk-a", base_url="http://gw", http_client=http, max_retries=0
            ) as sdk,
        ):
            with pytest.raises(anthropic.OverloadedError) as raised:
                await sdk.messages.create(**MESSAGES)
        assert raised.value.status_code == 529
        assert raised.value.response.headers["retry-after"] == "2"


async def test_a_prefill_decode_pool_tells_it_the_same_way() -> None:
    workers = [Overloaded(), Overloaded(), Overloaded()]
    async with _gateway(workers, prefill=1) as gw:
        messages = await gw.client.post("/v1/messages", json=MESSAGES, headers=ANTHROPIC_KEY)
        assert messages.status_code == 529, messages.text
        assert messages.json()["error"]["type"] == "overloaded_error"
        assert messages.headers["retry-after"] == "2" and "x-should-retry" not in messages.headers
        assert sum(len(w.posts) for w in workers) >= 2  # another round was tried
        assert _requests_counted(gw, "messages", "529") == 1


async def test_a_decode_workers_529_after_its_prefill_leg_tries_another_pair() -> None:
    """vLLM: the prefill leg was served and the decode worker answers 529. That worker is
    overloaded, not a failed transfer: the next round is another pair (the prompt's KV is still
    on the prefill worker), not the request recomputed alone, and no transfer failure is counted."""
    legs: list[tuple[str, str]] = []

    def worker(name: str) -> Any:
        async def chat(request: web.Request) -> web.Response:
            params = (await request.json()).get("kv_transfer_params")
            leg = "prefill" if isinstance(params, dict) and params.get("do_remote_decode") else "decode"
            legs.append((name, leg if params else "alone"))
            if leg == "prefill":
                kv = {"remote_engine_id": "e", "remote_block_ids": [1]}
                usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
                return web.json_response({"id": "p", "choices": [], "usage": usage, "kv_transfer_params": kv})
            if name == "d1":
                body = {"error": {"message": "Overloaded", "code": 529}}
                return web.json_response(body, status=529, headers={"Retry-After": "2"})
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return web.json_response({"choices": [{"message": {"content": "ok"}}], "usage": usage})

        return chat

    async with contextlib.AsyncExitStack() as stack:
        urls = {n: await serve_worker(stack, {"/v1/chat/completions": worker(n)}) for n in ("p1", "d1", "d2")}
        pool = pd_pool([urls["p1"]], [urls["d1"], urls["d2"]], retry_attempts=2)
        config = {"pools": [pool], "tenants": [tenant("a", "sk-a")], "scrape": {"enabled": False}}
        async with gateway_in_process(config, RoundRobin(), secret=SECRET) as gw:
            for _ in range(4):
                legs.clear()
                chat = await gw.client.post("/v1/chat/completions", json=CHAT, headers=OPENAI_KEY)
                assert chat.status_code == 200, chat.text
                assert ("d1", "decode") not in legs or legs[-1] == ("d2", "decode"), legs
                assert all(leg != "alone" for _, leg in legs), legs
            text = gw.state.routing.metrics.render().decode()
            assert 'kvgate_pd_transfer_failures_total{pool="p",reason="decode_error"}' not in text
