"""A whole answer stays reserved in the answer budget until it has been written to its client
(`answer_write.HeldResponse`), and is given back exactly once on every other way a request ends
with it: a worker's 5xx or malformed 200 read whole, a 4xx whose body is rewritten, the send
failing, the writing task or the reading request cancelled. The tenant's share comes back with
the budget."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.answer_write import WRITE_PIECE_BYTES, HeldResponse
from gateway.upstream import AnswerBudget, Reservation, UpstreamPool
from gateway.upstream_conn import WorkerConnection
from tests.gateway.answer_rig import gateway
from tests.gateway.fake_upstream import Handler, Server, post, whole_answer
from tests.gateway.routes_rig import KEY
from tests.support.loopback import serve_app
from tests.support.transports import TRANSPORTS
from tests.support.wait import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _held(budget: AnswerBudget, size: int) -> Reservation:
    held = Reservation(budget.share("t"))
    assert held.take(size)
    return held


async def _ignore(_: Any) -> None:
    return None


async def test_a_large_answer_is_written_in_pieces_then_released_once() -> None:
    budget = AnswerBudget(16 << 20, weights={"t": 1.0, "u": 1.0}, min_share_bytes=1 << 20)
    body = bytearray(b"x" * (2 * WRITE_PIECE_BYTES + 5))
    held = _held(budget, len(body))
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        assert budget.held_bytes == len(body)  # reserved while every piece is handed over
        sent.append(message)

    await HeldResponse(200, body, [(b"content-type", b"application/json")], held)({}, _ignore, send)
    start, *pieces = sent
    assert (b"content-length", str(len(body)).encode()) in start["headers"]
    assert [len(p["body"]) for p in pieces] == [WRITE_PIECE_BYTES, WRITE_PIECE_BYTES, 5]
    assert [p["more_body"] for p in pieces] == [True, True, False]
    assert all(isinstance(p["body"], bytes) for p in pieces)
    assert b"".join(p["body"] for p in pieces) == body
    assert (budget.held_bytes, budget.held_by("t")) == (0, 0)
    held.release()  # whoever else still has it gives nothing back twice
    assert budget.held_bytes == 0


async def test_a_small_answer_is_one_message_and_released() -> None:
    budget = AnswerBudget(1 << 20)
    held = _held(budget, 11)
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await HeldResponse(200, b'{"ok": true}', [], held)({}, _ignore, send)
    assert sent[1] == {"type": "http.response.body", "body": b'{"ok": true}'}
    assert budget.held_bytes == 0


async def test_a_write_that_fails_or_is_cancelled_releases_its_answer() -> None:
    budget = AnswerBudget(16 << 20)
    body = b"x" * (3 * WRITE_PIECE_BYTES)

    async def fails(message: Any) -> None:
        if message.get("more_body"):
            raise OSError("the client's connection broke")

    with pytest.raises(OSError):
        await HeldResponse(200, body, [], _held(budget, len(body)))({}, _ignore, fails)
    assert budget.held_bytes == 0

    pieces = 0

    async def slow(message: Any) -> None:
        nonlocal pieces
        if message["type"] == "http.response.body":
            pieces += 1
            await asyncio.Event().wait()  # a client that never reads: flow control waits

    writing = asyncio.create_task(HeldResponse(200, body, [], _held(budget, len(body)))({}, _ignore, slow))
    await wait_until(lambda: pieces == 1, what="the first piece handed over")
    assert budget.held_bytes == len(body)
    writing.cancel()  # the drain deadline or a shutdown
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert budget.held_bytes == 0


async def test_a_request_cancelled_just_as_its_answer_arrives_releases_it(
    serve: Callable[[Handler], Awaitable[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer is complete (the reply holds the reservation) but the waiting task is cancelled
    before it resumes: nobody will take the reply, so the pool gives its bytes back."""

    server = await serve(whole_answer(4000))
    budget = AnswerBudget(1 << 20)
    pool = UpstreamPool(budget=budget)
    tasks: list[asyncio.Task[Any]] = []
    complete = WorkerConnection.on_message_complete

    def complete_then_cancel(conn: WorkerConnection) -> None:
        complete(conn)
        tasks[0].cancel()  # the client left in the same turn of the loop

    monkeypatch.setattr(WorkerConnection, "on_message_complete", complete_then_cancel)
    call = pool.post("127.0.0.1", server.port, post(), connect_s=1.0, read_s=5.0, total_s=10.0)
    tasks.append(asyncio.create_task(call))
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert budget.held_bytes == 0
    pool.close()


def _chat_answer(content_bytes: int) -> bytes:
    answer = {
        "id": "c1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * content_bytes}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    return orjson.dumps(answer)


@contextlib.asynccontextmanager
async def answering(status: int, body: bytes, content_type: str) -> AsyncIterator[str]:
    """A worker that answers every chat request with `status` and `body` (and is healthy)."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def reply(_: web.Request) -> web.Response:
        return web.Response(status=status, body=body, headers={"content-type": content_type})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", reply)
    runner, port = await serve_app(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])  # streamed: a whole answer read from the stream
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("status", "body", "content_type", "client_status"),
    [
        (200, _chat_answer(3 * WRITE_PIECE_BYTES), "application/json", 200),  # served, in pieces
        (200, b"[1, 2]" + b" " * (2 * WRITE_PIECE_BYTES), "application/json", 502),  # not an object
        (400, b'{"message": "bad"}' + b" " * (2 * WRITE_PIECE_BYTES), "application/json", 400),  # rewritten
        (500, b"x" * (2 * WRITE_PIECE_BYTES), "text/plain", 502),  # the worker's error
    ],
)
async def test_every_way_a_whole_answer_ends_gives_its_bytes_back_once(
    transport: str, stream: bool, status: int, body: bytes, content_type: str, client_status: int
) -> None:
    async with answering(status, body, content_type) as url, gateway(url, transport) as (gw, _):
        answers = gw.state.transport.answers
        resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=KEY)
        assert resp.status_code == client_status, resp.text
        if client_status == 200:
            assert resp.content == body
        await wait_until(lambda: answers.held_bytes == 0, what="the answer budget back to 0")
        assert answers.held_by("t") == 0
