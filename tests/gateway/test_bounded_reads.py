"""Worker answers read off the request path are bounded too: render mode's token-id answers go
through `read_whole` (the per-answer cap and the process's budget), and the health probe reads at
most `MAX_HEALTH_ANSWER_BYTES` of a health answer. A worker on 127.0.0.1 that answers without
end shows both stop reading (each test would hang otherwise) with a clear outcome."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from gateway.errors import ApiError
from gateway.health import probe_health
from gateway.registry import Pool
from gateway.render import _render
from gateway.upstream import AnswerBudget, AnswerHold
from tests.support.processes import free_port

CHUNK = b"[" + b"1," * 32767  # 64 KiB of a token-id list that never ends


class EndlessWorker:
    """Answers every request with `status` and a body that never ends; `hung_up` is set when
    the client closes the connection."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.hung_up = asyncio.Event()
        self.url = ""

    async def answer(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=self.status, headers={"content-type": "application/json"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(CHUNK)
        except (ConnectionError, asyncio.CancelledError):
            self.hung_up.set()
            raise


@pytest.fixture
async def endless() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(status: int = 200) -> EndlessWorker:
        worker = EndlessWorker(status)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", worker.answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        worker.url = f"http://127.0.0.1:{port}"
        return worker

    yield start
    for runner in runners:
        await runner.cleanup()


class _PoolStub:
    client_timeout = aiohttp.ClientTimeout(total=30)


async def render(session: aiohttp.ClientSession, url: str, budget: AnswerHold, *, required: bool) -> Any:
    pool = cast(Pool, _PoolStub())
    return await _render(session, url + "/tokenize", {"prompt": "x"}, {}, pool, budget, required=required)


async def test_an_endless_render_answer_stops_at_the_per_answer_cap(
    endless: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gateway.upstream_conn.MAX_ANSWER_BYTES", 1 << 20)
    worker = await endless()
    budget = AnswerBudget(8 << 20)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ApiError) as raised:
            await render(session, worker.url, budget, required=True)
        assert await render(session, worker.url, budget, required=False) is None
    assert (raised.value.status, raised.value.code) == (502, "bad_gateway")
    assert "too large" in raised.value.message
    assert budget.held_bytes == 0 and budget.refusals.value == 0
    await asyncio.wait_for(worker.hung_up.wait(), 10)


async def test_a_render_answer_past_the_budget_is_the_gateways_503(endless: Any) -> None:
    worker = await endless()
    budget = AnswerBudget(1 << 20)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ApiError) as raised:
            await render(session, worker.url, budget, required=True)
    err = raised.value
    assert (err.status, err.code, err.headers.get("retry-after")) == (503, "gateway_overloaded", "1")
    assert "limits.max_buffered_answer_bytes" in err.message
    assert budget.held_bytes == 0 and budget.refusals.value == 1


async def test_a_render_answer_is_held_to_its_tenants_share(endless: Any) -> None:
    """Rendering reads within the request's tenant's share (keying passes it): one tenant's large
    renders cannot take the budget the other tenants' answers need."""
    worker = await endless()
    budget = AnswerBudget(4 << 20, weights={"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, min_share_bytes=1 << 20)
    share = budget.share("a")
    assert share.share_bytes == 1 << 20
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ApiError) as raised:
            await render(session, worker.url, share, required=True)
    assert raised.value.status == 503 and "share" in raised.value.message
    assert share.held_bytes == 0 and budget.held_bytes == 0


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (500, False)])
async def test_the_health_probe_stops_reading_an_endless_answer(
    endless: Any, status: int, healthy: bool
) -> None:
    worker = await endless(status)
    async with aiohttp.ClientSession() as session:
        assert await probe_health(worker.url, 30.0, session, {}) is healthy
    await asyncio.wait_for(worker.hung_up.wait(), 10)
