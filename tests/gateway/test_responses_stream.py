"""In-process checks of how a streamed retrieve (`GET /v1/responses/{id}?stream=true`) gives
everything back when the gateway ends it: the tenant's slot, the request's count, the stream's
place among the open ones, and the worker's request (`tests/support/responses_worker.py`, served
in the test's loop so its log is read directly)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.app import drain
from gateway.auth import hash_api_key
from gateway.state import GatewayState
from policies import make_policy
from tests.support.gateway_config import SECRET
from tests.support.inprocess import gateway_in_process
from tests.support.processes import free_port
from tests.support.responses_worker import State, make_app
from tests.support.wait import wait_until

HEADERS = {"authorization": "Bearer sk"}


@dataclass
class _Stack:
    state: GatewayState
    client: httpx.AsyncClient
    worker: State
    worker_url: str

    async def create(self) -> str:
        """A stored response's id (the gateway's, as the worker names it)."""
        resp = await self.client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=HEADERS)
        assert resp.status_code == 200
        rid: str = resp.json()["id"]
        return rid

    async def streamed_retrieve(self) -> tuple[asyncio.Task[httpx.Response], str]:
        """A created response's streamed retrieve, once the worker is holding its stream, and
        the response's id."""
        rid = await self.create()
        task = asyncio.create_task(
            self.client.get(f"/v1/responses/{rid}", params={"stream": "true"}, headers=HEADERS)
        )
        await wait_until(lambda: self.state.lifecycle.active_streams and self.worker.retrieves)
        return task, rid

    def settled(self, status: str) -> bool:
        """Everything the retrieve held is back, and it was counted once with `status`."""
        metrics = self.state.routing.metrics.render().decode().splitlines()
        counted = [
            line
            for line in metrics
            if line.startswith("kvgate_requests_total{") and 'endpoint="responses.retrieve"' in line
        ]
        return (
            self.state.gate.limiters["t"].in_flight == 0
            and not self.state.lifecycle.active_streams
            and len(counted) == 1
            and f'status="{status}"' in counted[0]
            and counted[0].endswith(" 1.0")
        )


@contextlib.asynccontextmanager
async def _stack() -> AsyncIterator[_Stack]:
    worker = State()
    runner = web.AppRunner(make_app(worker), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    raw = {
        "pools": [{"name": "p", "models": ["m"], "workers": [url]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "scrape": {"enabled": False},
    }
    try:
        async with gateway_in_process(raw, make_policy("round_robin"), secret=SECRET) as gw:
            await wait_until(lambda: all(w.healthy for w in gw.state.registry.pools["p"].workers.values()))
            yield _Stack(gw.state, gw.client, worker, url)
    finally:
        await runner.cleanup()


def _kinds_and_last(body: bytes) -> tuple[list[str], dict[str, object]]:
    events = [orjson.loads(e.split(b"data: ", 1)[1]) for e in body.split(b"\n\n") if e]
    return [e["type"] for e in events], events[-1]


async def test_a_worker_dying_mid_stream_gives_everything_back() -> None:
    async with _stack() as stack:
        held, rid = await stack.streamed_retrieve()
        async with httpx.AsyncClient() as direct:
            assert (await direct.post(f"{stack.worker_url}/_die/{rid}")).status_code == 200
        resp = await held
        kinds, last = _kinds_and_last(resp.content)
        assert kinds == ["response.created", "response.in_progress", "error"]
        assert last["code"] == "upstream_stream_error"
        await wait_until(lambda: stack.settled("502"))


async def test_the_drain_deadline_ends_the_stream_and_closes_the_workers_request() -> None:
    async with _stack() as stack:
        held, rid = await stack.streamed_retrieve()
        await drain(stack.state, 0.0)
        resp = await held
        kinds, last = _kinds_and_last(resp.content)
        assert kinds == ["response.created", "response.in_progress", "error"]
        assert last["code"] == "gateway_shutting_down"
        await wait_until(lambda: stack.settled("503"))
        await wait_until(lambda: rid in stack.worker.closed_early)


async def test_a_gateway_bug_in_the_relay_is_logged_and_counted_500(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, chunk: bytes) -> bytes:
        raise RuntimeError("a bug")

    async with _stack() as stack:
        rid = await stack.create()
        monkeypatch.setattr("gateway.responses_stream.ResponsesRelay.feed", broken)
        with contextlib.suppress(httpx.HTTPError):
            await stack.client.get(f"/v1/responses/{rid}", params={"stream": "true"}, headers=HEADERS)
        await wait_until(lambda: stack.settled("500"))
