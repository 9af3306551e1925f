"""The lean client's streamed answers, against small asyncio workers on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.stream_body import STREAM_READ_BYTES, STREAM_TIGHT_BYTES
from gateway.upstream import StreamBuffers, UpstreamError, UpstreamPool, UpstreamStream, UpstreamTimeout
from tests.gateway.fake_upstream import Handler, Server, post, read_request
from tests.gateway.manual_clock import ManualClock
from tests.support.wait import wait_until

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


PIECE = b"x" * 65536
PIECES = 64  # 4 MiB, four times the pause threshold


async def four_mib_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    """A worker that streams 4 MiB as fast as it is read, then waits until the gateway hangs up."""
    await read_request(reader)
    writer.write(SSE_HEAD)
    for _ in range(PIECES):
        writer.write(chunk(PIECE))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    await reader.read()


async def open_stream(pool: UpstreamPool, server: Server, read_s: float = 2.0) -> UpstreamStream:
    return await pool.open_stream(
        "127.0.0.1", server.port, post(), connect_s=1.0, read_s=read_s, total_s=10.0
    )


async def test_chunks_arrive_as_sent_and_the_connection_is_reused(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    step = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            await read_request(reader)
            writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
            await writer.drain()
            await step.wait()
            step.clear()
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

    server = await serve(handler)
    pool = UpstreamPool()
    for _ in range(2):
        stream = await open_stream(pool, server)
        assert (stream.status, stream.content_type) == (200, "text/event-stream; charset=utf-8")
        assert await stream.read() == b"data: 1\n\n"  # before the worker sends the rest
        step.set()
        assert await stream.read() == b"data: [DONE]\n\n"
        assert await stream.read() == b""
        stream.release()
    assert server.connections == 1  # read to its end, the connection served the second stream
    assert pool._slots == {}
    pool.close()


async def test_closing_a_stream_drops_the_connection_and_frees_the_slot(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # until the gateway hangs up

    server = await serve(handler)
    pool = UpstreamPool(max_open_per_worker=1)
    stream = await open_stream(pool, server)
    assert await stream.read() == b"data: 1\n\n"
    stream.close()
    stream.close()  # idempotent: the slot is given back once
    async with asyncio.timeout(2):
        await server.closed.wait()  # the worker saw the connection go
    assert pool._slots == {}
    again = await open_stream(pool, server)  # the only slot is free again
    again.close()
    pool.close()


async def test_a_silent_worker_mid_stream_times_out_and_a_dying_one_fails(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        if n == 1:
            await reader.read()  # silent until the gateway hangs up
        # the second connection dies mid-answer (the fixture closes it)

    server = await serve(handler)
    clock = ManualClock()
    pool = UpstreamPool(sweep=clock.sweep)
    stream = await open_stream(pool, server, read_s=1.0)
    assert await stream.read() == b"data: 1\n\n"
    reading = asyncio.create_task(stream.read())
    clock.advance(0.75)
    assert stream._conn.alive and stream._conn.body.error is None
    clock.advance(0.25)
    with pytest.raises(UpstreamTimeout) as timed_out:
        await asyncio.wait_for(reading, 10)
    assert timed_out.value.answered
    stream.close()
    stream = await open_stream(pool, server)
    assert await stream.read() == b"data: 1\n\n"
    with pytest.raises(UpstreamError, match="closed"):
        await stream.read()
    stream.close()
    pool.close()


async def test_a_lagging_reader_pauses_the_worker_and_loses_nothing(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    server = await serve(four_mib_stream)
    clock = ManualClock()
    pool = UpstreamPool(sweep=clock.sweep)
    stream = await open_stream(pool, server, read_s=1.0)
    await wait_until(lambda: stream._conn._paused)
    clock.advance(5.0)  # the reader lags longer than read_s: a paused worker is not a silent one
    assert stream._conn.alive and stream._conn.body.error is None
    assert stream._conn._paused and stream._conn.body.size < 2 * 1024 * 1024
    total = 0
    while data := await stream.read():
        total += len(data)
    assert total == len(PIECE) * PIECES
    stream.release()
    pool.close()


async def test_streams_past_the_process_budget_stop_reading_sooner_and_give_bytes_back(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    server = await serve(four_mib_stream)
    buffers = StreamBuffers(256 * 1024)
    pool = UpstreamPool(streams=buffers)
    first = await open_stream(pool, server)
    await wait_until(lambda: first._conn._paused)
    second = await open_stream(pool, server)
    await wait_until(lambda: second._conn._paused)
    # The budget is spent: the second stream stopped past 64 KiB (plus what one socket read
    # brought), not past the 1 MiB a stream may hold while the process is under its budget.
    one_read = 256 * 1024
    assert buffers.held_bytes > buffers.capacity_bytes
    assert STREAM_TIGHT_BYTES < second._conn.body.size <= STREAM_TIGHT_BYTES + one_read
    assert buffers.held_bytes == first._conn.body.size + second._conn.body.size
    second.close()  # its unread bytes are given back
    assert buffers.held_bytes == first._conn.body.size
    total = 0
    while data := await first.read():
        assert len(data) <= STREAM_READ_BYTES  # the rest stays in the body, counted
        assert buffers.held_bytes == first._conn.body.size
        total += len(data)
    assert total == len(PIECE) * PIECES  # paused and resumed, nothing lost
    first.release()
    assert buffers.held_bytes == 0
    pool.close()


async def test_a_stream_opened_and_abandoned_before_its_head_was_taken_gives_its_bytes_back(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))  # the head and a first event in one write
        await writer.drain()
        await reader.read()

    server = await serve(handler)
    buffers = StreamBuffers(1024 * 1024)
    pool = UpstreamPool(streams=buffers)
    conn = await pool._connect("127.0.0.1", server.port, 1.0)
    head = await conn.stream(post(), 2.0, 10.0)
    assert head.status == 200
    await wait_until(lambda: conn.body.size > 0)
    assert buffers.held_bytes == conn.body.size
    conn.abort()  # as `open_stream` does when it is cancelled before handing the stream over
    assert buffers.held_bytes == 0
    pool.close()
