"""The process's budget for whole answers: the lean client (against scripted raw-socket servers on
127.0.0.1) and `read_whole` / `read_reserved` (both transports' whole reads) reserve every byte
as it arrives and give it all back on every path: served (when the reply's taker releases it),
cut off by the budget or the per-answer cap, the worker closing or going silent, the caller
cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import ClientSession, web

from gateway.config import LimitsConfig
from gateway.config.pool import TimeoutsConfig
from gateway.errors import ApiError
from gateway.failure import Stage, failure_of
from gateway.responses_routes import _whole
from gateway.streaming import AiohttpSource
from gateway.upstream import (
    DEFAULT_BUDGET_BYTES,
    MAX_ANSWER_BYTES,
    AnswerBudget,
    AnswerBudgetExceeded,
    UpstreamError,
    UpstreamPool,
    UpstreamReply,
    UpstreamTimeout,
    read_whole,
)
from policies.base import Outcome
from tests.gateway.fake_upstream import ANSWER_HEAD, Handler, Server, held_answer, post, read_request
from tests.gateway.manual_clock import ManualClock
from tests.support.processes import free_port
from tests.support.wait import wait_until


def test_the_budget_never_passes_its_capacity_and_counts_refusals() -> None:
    budget = AnswerBudget(100)
    assert budget.reserve(60) and budget.reserve(40)
    assert not budget.reserve(1) and budget.held_bytes == 100 and budget.refusals.value == 1
    budget.release(60)
    assert budget.reserve(50) and budget.held_bytes == 90
    budget.release(90)
    assert budget.held_bytes == 0


def test_the_default_is_eight_answers_at_the_per_answer_cap() -> None:
    assert LimitsConfig().max_buffered_answer_bytes == DEFAULT_BUDGET_BYTES == 8 * MAX_ANSWER_BYTES


def test_a_refusal_is_the_gateways_503_and_no_verdict_on_the_worker() -> None:
    failure = failure_of(AnswerBudgetExceeded(AnswerBudget(2048)), Stage.HEAD, TimeoutsConfig())
    assert (failure.status, failure.code, failure.outcome, failure.retry) == (
        503,
        "gateway_overloaded",
        Outcome.ABORTED,
        None,
    )
    assert "limits.max_buffered_answer_bytes" in failure.message
    assert failure.error().headers["retry-after"] == "1"


async def send(pool: UpstreamPool, server: Server, read_s: float = 5.0) -> UpstreamReply:
    return await pool.post("127.0.0.1", server.port, post(), connect_s=1.0, read_s=read_s, total_s=10.0)


async def test_answers_past_the_budget_are_cut_off_and_the_rest_served(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    # Each answer is 2001 bytes, its last byte held until `go`: two fit in 5000, a third does not.
    go = asyncio.Event()
    server = await serve(held_answer(go))
    pool = UpstreamPool(budget=AnswerBudget(5000))
    sent = [asyncio.create_task(send(pool, server)) for _ in range(3)]
    done, _ = await asyncio.wait(sent, return_when=asyncio.FIRST_COMPLETED)
    with pytest.raises(AnswerBudgetExceeded):
        done.pop().result()
    await wait_until(lambda: pool.budget.held_bytes == 4000, what="two answers held")
    go.set()
    replies = [task.result() for task in await asyncio.wait_for(_finished(sent), 10)]
    assert sorted(len(r.body) for r in replies) == [2001, 2001]
    # A served answer stays reserved until its taker releases it (once written to the client).
    assert pool.budget.held_bytes == 4002 and pool.budget.refusals.value == 1
    for reply in replies:
        reply.release()
        reply.release()  # a second release gives nothing back twice
    assert pool.budget.held_bytes == 0
    pool.close()


async def _finished(tasks: list[asyncio.Task[UpstreamReply]]) -> list[asyncio.Task[UpstreamReply]]:
    await asyncio.wait(tasks)
    return [t for t in tasks if t.exception() is None]


async def test_every_failed_read_gives_its_bytes_back(
    serve: Callable[[Handler], Awaitable[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ANSWER_HEAD % 5000 + b"x" * 1000)
        await writer.drain()  # then the connection closes mid-answer

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ANSWER_HEAD % 5000 + b"x" * 1000)
        await writer.drain()
        await reader.read()

    async def too_large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ANSWER_HEAD % 5000 + b"x" * 5000)
        await writer.drain()
        await reader.read()

    clock = ManualClock()
    pool = UpstreamPool(budget=AnswerBudget(1 << 20), sweep=clock.sweep)
    with pytest.raises(UpstreamError, match="closed"):
        await send(pool, await serve(closes))
    assert pool.budget.held_bytes == 0
    stalled = asyncio.create_task(send(pool, await serve(silent)))
    await wait_until(lambda: pool.budget.held_bytes == 1000, what="the answer's first bytes held")
    clock.advance(5.0)  # the read timeout
    with pytest.raises(UpstreamTimeout):
        await asyncio.wait_for(stalled, 10)
    assert pool.budget.held_bytes == 0
    monkeypatch.setattr("gateway.upstream_conn.MAX_ANSWER_BYTES", 3000)
    with pytest.raises(UpstreamError, match="too large"):
        await send(pool, await serve(too_large))
    assert pool.budget.held_bytes == 0 and pool.budget.refusals.value == 0
    pool.close()


async def test_a_cancelled_read_gives_its_bytes_back(serve: Callable[[Handler], Awaitable[Server]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ANSWER_HEAD % 5000 + b"x" * 1000)
        await writer.drain()
        await reader.read()  # until the client hangs up

    server = await serve(handler)
    pool = UpstreamPool(budget=AnswerBudget(1 << 20))
    task = asyncio.create_task(send(pool, server))
    await wait_until(lambda: pool.budget.held_bytes == 1000, what="the answer's first bytes held")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.budget.held_bytes == 0
    await asyncio.wait_for(server.closed.wait(), 10)  # the worker was hung up on
    pool.close()


def _reader(*chunks: bytes, then: BaseException | None = None) -> Callable[[], Awaitable[bytes]]:
    async def gen() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
        if then is not None:
            raise then

    it = gen()

    async def read() -> bytes:
        return await anext(it, b"")

    return read


async def test_read_whole_holds_and_releases_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = AnswerBudget(1000)
    assert await read_whole(_reader(b"a" * 400, b"b" * 400), budget) == b"a" * 400 + b"b" * 400
    assert budget.held_bytes == 0
    with pytest.raises(AnswerBudgetExceeded):
        await read_whole(_reader(b"a" * 600, b"b" * 600), budget)
    assert budget.held_bytes == 0 and budget.refusals.value == 1
    with pytest.raises(OSError):
        await read_whole(_reader(b"a" * 600, then=OSError("reset")), budget)
    assert budget.held_bytes == 0
    with pytest.raises(asyncio.CancelledError):
        await read_whole(_reader(b"a" * 600, then=asyncio.CancelledError()), budget)
    assert budget.held_bytes == 0
    monkeypatch.setattr("gateway.upstream_conn.MAX_ANSWER_BYTES", 500)
    with pytest.raises(UpstreamError, match="too large"):
        await read_whole(_reader(b"a" * 400, b"b" * 400), budget)
    assert budget.held_bytes == 0


async def test_concurrent_whole_reads_share_one_budget() -> None:
    budget = AnswerBudget(1000)
    gate = asyncio.Event()

    def held_reader() -> Callable[[], Awaitable[bytes]]:
        sent = 0

        async def read() -> bytes:
            nonlocal sent
            sent += 1
            if sent == 1:
                return b"x" * 400
            if sent == 2:
                await gate.wait()
                return b"y" * 100
            return b""

        return read

    first = asyncio.create_task(read_whole(held_reader(), budget))
    second = asyncio.create_task(read_whole(held_reader(), budget))
    await wait_until(lambda: budget.held_bytes == 800, what="two reads holding")
    with pytest.raises(AnswerBudgetExceeded):
        await read_whole(_reader(b"z" * 300), budget)
    gate.set()
    assert [len(await first), len(await second)] == [500, 500]
    assert budget.held_bytes == 0


async def test_a_stored_response_cut_off_by_the_budget_is_the_gateways_503() -> None:
    """A retrieve (`GET /v1/responses/{id}`) read past the budget is the same 503 as the proxied
    routes', not "could not reach the worker"; the budget is given back."""

    async def stored(_: web.Request) -> web.Response:
        return web.json_response({"id": "resp_1", "output": "x" * 4096})

    app = web.Application()
    app.router.add_get("/r", stored)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    budget = AnswerBudget(1024)
    try:
        async with ClientSession() as session:
            resp = await session.get(f"http://127.0.0.1:{port}/r")
            with pytest.raises(ApiError) as raised:
                await _whole(AiohttpSource(resp, budget), TimeoutsConfig())
    finally:
        await runner.cleanup()
    err = raised.value
    assert (err.status, err.code, err.headers.get("retry-after")) == (503, "gateway_overloaded", "1")
    assert budget.held_bytes == 0 and budget.refusals.value == 1
