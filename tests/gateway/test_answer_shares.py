"""Each tenant's share of the process's budget for whole answers (`AnswerBudget.share`): one
tenant filling its share gets the gateway's 503 naming the share while another tenant's answers
are served, on the lean client (scripted raw-socket workers on 127.0.0.1) and through
`read_whole`; every path gives the tenant's bytes back. And the answer headers the lean client
keeps: one value per name, so a repeated `retry-after` cannot crowd out `metadata`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.config.pool import TimeoutsConfig
from gateway.failure import Stage, failure_of
from gateway.upstream import (
    AnswerBudget,
    AnswerBudgetExceeded,
    UpstreamError,
    UpstreamPool,
    UpstreamReply,
    read_whole,
)
from tests.gateway.fake_upstream import Handler, Server, held_answer, post, read_request, whole_answer
from tests.gateway.test_answer_budget import _reader
from tests.support.wait import wait_until


def test_a_share_is_the_tenants_weight_of_the_capacity_at_least_one_answer() -> None:
    budget = AnswerBudget(1000, weights={"a": 3.0, "b": 1.0}, min_share_bytes=100)
    assert (budget.share_bytes("a"), budget.share_bytes("b")) == (750, 250)
    assert budget.share_bytes("stranger") == 200  # weighs 1 among 5
    many = AnswerBudget(1000, weights={f"t{i}": 1.0 for i in range(20)}, min_share_bytes=100)
    assert many.share_bytes("t0") == 100  # 50 by weight, but one answer at the cap always fits
    assert AnswerBudget(1000).share_bytes("a") == 1000  # no tenants known: the whole budget
    assert AnswerBudget(1000, weights={"a": 1.0}).share_bytes("a") == 1000


def test_a_tenant_past_its_share_is_refused_while_the_other_is_served() -> None:
    budget = AnswerBudget(1000, weights={"a": 1.0, "b": 1.0})
    a, b = budget.share("a"), budget.share("b")
    assert budget.share("a") is a
    assert a.reserve(300) and a.reserve(200)
    assert not a.reserve(1)
    # Counted as the tenant's refusal, not the process budget's.
    assert (a.held_bytes, budget.held_bytes, a.refusals.value, budget.refusals.value) == (500, 500, 1, 0)
    refusal = AnswerBudgetExceeded(a, 1)
    assert "this tenant's share" in str(refusal) and "500 bytes of" in str(refusal)
    failure = failure_of(refusal, Stage.ANSWER, TimeoutsConfig())
    assert (failure.status, failure.code) == (503, "gateway_overloaded")
    assert failure.error().headers["retry-after"] == "1"
    assert b.reserve(500) and budget.held_bytes == 1000
    a.release(500)
    b.release(500)
    assert (budget.held_by("a"), budget.held_by("b"), budget.held_bytes) == (0, 0, 0)


def test_the_whole_budget_refuses_a_tenant_within_its_share_with_the_budgets_message() -> None:
    budget = AnswerBudget(1000, weights={"a": 1.0, "b": 1.0}, min_share_bytes=800)
    a, b = budget.share("a"), budget.share("b")
    assert a.reserve(700)
    assert not b.reserve(400)  # within b's 800, past the budget's 1000
    assert b.held_bytes == 0 and budget.held_bytes == 700
    assert "its limit of worker answers" in str(AnswerBudgetExceeded(b, 400))
    a.release(700)


async def send(pool: UpstreamPool, server: Server, tenant: str, read_s: float = 5.0) -> UpstreamReply:
    hold = pool.budget.share(tenant)
    return await pool.post(
        "127.0.0.1", server.port, post(), connect_s=1.0, read_s=read_s, total_s=10.0, hold=hold
    )


async def test_a_tenant_filling_its_share_leaves_the_others_answers_served(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    # Each answer is 2001 bytes, its last byte held until `go`. Shares are 3000 each: tenant A's
    # second answer passes its share (the budget still has room), tenant B's is served.
    go = asyncio.Event()
    server = await serve(held_answer(go))
    budget = AnswerBudget(6000, weights={"a": 1.0, "b": 1.0})
    pool = UpstreamPool(budget=budget)
    first_a = asyncio.create_task(send(pool, server, "a"))
    await wait_until(lambda: budget.held_by("a") == 2000, what="tenant A's first answer held")
    with pytest.raises(AnswerBudgetExceeded, match="this tenant's share"):
        await send(pool, server, "a")
    assert budget.held_by("a") == 2000 and budget.share("a").refusals.value == 1
    for_b = asyncio.create_task(send(pool, server, "b"))
    await wait_until(lambda: budget.held_by("b") == 2000, what="tenant B's answer held")
    go.set()
    replies = await asyncio.wait_for(asyncio.gather(first_a, for_b), 10)
    assert [len(r.body) for r in replies] == [2001, 2001]
    # Each served answer is its tenant's until released (written to the client).
    assert (budget.held_by("a"), budget.held_by("b"), budget.held_bytes) == (2001, 2001, 4002)
    replies[0].release()
    assert (budget.held_by("a"), budget.held_by("b"), budget.held_bytes) == (0, 2001, 2001)
    replies[1].release()
    assert (budget.held_by("a"), budget.held_by("b"), budget.held_bytes) == (0, 0, 0)
    pool.close()


async def test_a_streamed_answer_read_whole_holds_its_tenants_share(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    server = await serve(whole_answer(4000))
    budget = AnswerBudget(6000, weights={"a": 1.0, "b": 1.0})
    pool = UpstreamPool(budget=budget)
    stream = await pool.open_stream(
        "127.0.0.1", server.port, post(), connect_s=1.0, read_s=5.0, total_s=10.0, hold=budget.share("a")
    )
    with pytest.raises(AnswerBudgetExceeded, match="this tenant's share"):
        await stream.read_all()
    stream.close()
    assert (budget.held_by("a"), budget.held_bytes) == (0, 0)
    pool.close()


async def test_read_whole_gives_the_tenants_bytes_back_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = AnswerBudget(2000, weights={"a": 1.0, "b": 1.0})
    a = budget.share("a")
    assert await read_whole(_reader(b"a" * 400, b"b" * 400), a) == b"a" * 400 + b"b" * 400
    with pytest.raises(AnswerBudgetExceeded, match="this tenant's share"):
        await read_whole(_reader(b"a" * 600, b"b" * 600), a)
    with pytest.raises(OSError):
        await read_whole(_reader(b"a" * 600, then=OSError("reset")), a)
    with pytest.raises(asyncio.CancelledError):
        await read_whole(_reader(b"a" * 600, then=asyncio.CancelledError()), a)
    monkeypatch.setattr("gateway.upstream_conn.MAX_ANSWER_BYTES", 500)
    with pytest.raises(UpstreamError, match="too large"):
        await read_whole(_reader(b"a" * 400, b"b" * 400), a)
    assert (budget.held_by("a"), budget.held_bytes, a.refusals.value) == (0, 0, 1)


async def test_one_value_per_answer_header_so_metadata_is_kept(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        repeated = b"".join(b"Retry-After: %d\r\n" % i for i in range(1, 5))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            + repeated
            + b'retry-after-ms: 10\r\nRetry-After-Ms: 20\r\nMetadata: {"shape": [2]}\r\n'
            + b"Content-Length: 2\r\n\r\nok"
        )
        await writer.drain()
        await reader.read()

    pool = UpstreamPool(budget=AnswerBudget(1 << 20))
    reply = await send(pool, await serve(handler), "a")
    assert reply.retry_hints == (
        (b"retry-after", b"1"),
        (b"retry-after-ms", b"10"),
        (b"metadata", b'{"shape": [2]}'),
    )
    pool.close()
