"""The lean upstream client against scripted raw-socket servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.upstream import (
    AnswerTimeLimit,
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamReply,
    UpstreamTimeout,
)
from gateway.upstream_address import direct_address
from gateway.upstream_conn import WorkerConnection
from tests.gateway.fake_upstream import OK, Handler, Server, post, read_request
from tests.gateway.manual_clock import ManualClock
from tests.support.processes import free_port
from tests.support.wait import wait_until


def slots(pool: UpstreamPool, server: Server) -> int:
    """Requests holding or waiting for one of the worker's connection slots."""
    held = pool._slots.get(("127.0.0.1", server.port))
    return held.users if held is not None else 0


async def send(pool: UpstreamPool, server: Server, read_s: float = 2.0) -> UpstreamReply:
    return await pool.post("127.0.0.1", server.port, post(), connect_s=10.0, read_s=read_s, total_s=10.0)


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            server.requests.append(await read_request(reader))
            writer.write(OK)
            await writer.drain()

    server = await serve(handler)
    pool = UpstreamPool()
    for _ in range(3):
        reply = await send(pool, server)
        assert reply == UpstreamReply(200, "application/json", b'{"ok": 1}\r\n')
    assert server.connections == 1 and len(server.requests) == 3
    assert server.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert b"Content-Length: 2\r\n\r\n{}" in server.requests[0]
    pool.close()


async def test_chunked_answers_and_connection_close(serve: Callable[[Handler], Awaitable[Server]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        writer.write(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        await writer.drain()

    server = await serve(handler)
    pool = UpstreamPool()
    for _ in range(2):
        reply = await send(pool, server)
        assert (reply.status, reply.body) == (400, b"hello world")
    assert server.connections == 2  # the worker said close: never reused


async def test_an_idle_connection_the_worker_closed_is_replaced(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        # ... then close the keep-alive connection, as a worker's idle timeout would

    server = await serve(handler)
    pool = UpstreamPool()
    assert (await send(pool, server)).status == 200
    await server.closed.wait()
    idle = pool._idle[("127.0.0.1", server.port)]
    await wait_until(lambda: not any(conn.alive for conn in idle))  # the pool saw the close
    assert (await send(pool, server)).status == 200
    assert server.connections == 2


async def test_an_address_left_with_nothing_usable_idle_is_forgotten(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    # Workers come and go (pod IPs): the idle map must not keep every address ever seen.
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()

    async def keeps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()

    gone, staying, new = await serve(closes), await serve(keeps), await serve(keeps)
    pool = UpstreamPool()
    assert (await send(pool, staying)).status == 200 and (await send(pool, gone)).status == 200
    await gone.closed.wait()
    await wait_until(lambda: not pool._idle[("127.0.0.1", gone.port)][0].alive)
    assert (await send(pool, new)).status == 200  # a new address: the map is swept
    assert set(pool._idle) == {("127.0.0.1", staying.port), ("127.0.0.1", new.port)}
    assert (await send(pool, staying)).status == 200 and staying.connections == 1  # kept, reused
    pool.close()


async def test_timeouts_before_and_during_the_answer(serve: Callable[[Handler], Awaitable[Server]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        server.requests.append(await read_request(reader))
        if n == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            await writer.drain()
        await reader.read()  # silent until the client hangs up

    server = await serve(handler)
    clock = ManualClock()
    pool = UpstreamPool(sweep=clock.sweep)
    before = asyncio.create_task(send(pool, server, read_s=1.0))
    await wait_until(lambda: len(server.requests) == 1)
    clock.advance(1.0)
    with pytest.raises(UpstreamTimeout) as silent:
        await asyncio.wait_for(before, 10)
    assert silent.value.answered is False
    during = asyncio.create_task(send(pool, server, read_s=1.0))
    await wait_until(lambda: pool.budget.held_bytes == len(b"partial"), what="the first bytes arrived")
    clock.advance(1.0)
    with pytest.raises(UpstreamTimeout) as stalled:
        await asyncio.wait_for(during, 10)
    assert stalled.value.answered is True
    assert pool.budget.held_bytes == 0 and pool._slots == {}
    pool.close()


async def test_the_read_timeout_counts_from_the_last_byte_and_the_total_bounds_it_all(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n > 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            await writer.drain()
        await reader.read()

    server = await serve(handler)
    clock = ManualClock()
    pool = UpstreamPool(sweep=clock.sweep)

    async def exchange(
        read_s: float, total_s: float
    ) -> tuple[WorkerConnection, asyncio.Future[UpstreamReply]]:
        conn = await pool._connect("127.0.0.1", server.port, 1.0)
        return conn, conn.request(post(), read_s, total_s)

    # A silent worker: the read timeout passes exactly `read_s` after the request was sent.
    _, silent = await exchange(read_s=1.0, total_s=10.0)
    clock.advance(0.75)
    assert not silent.done()
    clock.advance(0.25)
    assert isinstance(silent.exception(), UpstreamTimeout)

    # Bytes that arrive start the silence over.
    conn, stalled = await exchange(read_s=1.0, total_s=10.0)
    clock.advance(0.75)  # before the worker's first bytes can arrive: no await since the request
    await wait_until(lambda: conn.got_bytes)
    clock.advance(0.75)  # 1.5 s since the request, 0.75 s since the last byte
    assert not stalled.done()
    clock.advance(0.25)
    assert isinstance(stalled.exception(), UpstreamTimeout) and not conn.alive

    # The total timeout ends an exchange whose worker was never silent for `read_s`.
    conn, bounded = await exchange(read_s=1.0, total_s=1.5)
    clock.advance(0.75)
    await wait_until(lambda: conn.got_bytes)
    clock.advance(0.5)
    assert not bounded.done()
    clock.advance(0.25)
    # A worker still answering when the total passes is not the worker's failure: the time an
    # answer takes is what the request asked for. Silent ones stay timeouts of the worker's.
    assert isinstance(bounded.exception(), AnswerTimeLimit)
    assert not isinstance(silent.exception(), AnswerTimeLimit)
    assert not isinstance(stalled.exception(), AnswerTimeLimit)
    assert pool.budget.held_bytes == 0
    pool.close()


async def test_connect_errors_and_a_worker_dying_mid_answer(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    pool = UpstreamPool()
    with pytest.raises(UpstreamConnectError) as refused:
        await pool.post("127.0.0.1", free_port(), post(), connect_s=1.0, read_s=1.0, total_s=1.0)
    assert refused.value.timed_out is False and refused.value.answered is False

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await writer.drain()

    server = await serve(handler)
    with pytest.raises(UpstreamError) as died:
        await send(pool, server)
    assert died.value.answered is True and not isinstance(died.value, UpstreamTimeout)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    bad = await serve(garbage)
    with pytest.raises(UpstreamError, match="malformed"):
        await send(pool, bad)


async def test_an_oversized_answer_is_refused(
    serve: Callable[[Handler], Awaitable[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gateway.upstream_conn.MAX_ANSWER_BYTES", 1000)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        await writer.drain()
        await asyncio.sleep(1)

    server = await serve(handler)
    with pytest.raises(UpstreamError, match="too large") as info:
        await send(UpstreamPool(), server)
    assert info.value.answered is True


async def test_cancelling_a_request_closes_its_connection(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        server.requests.append(await read_request(reader))
        await reader.read()  # returns when the client closes the connection

    server = await serve(handler)
    pool = UpstreamPool()
    task = asyncio.create_task(send(pool, server))
    await wait_until(lambda: server.requests)  # the worker is generating
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(2):
        await server.closed.wait()  # the worker saw the connection go: it stops generating


async def test_open_connections_per_worker_are_capped(serve: Callable[[Handler], Awaitable[Server]]) -> None:
    release = asyncio.Event()
    open_now = 0
    peak = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        nonlocal open_now, peak
        open_now += 1
        peak = max(peak, open_now)
        try:
            while True:
                server.requests.append(await read_request(reader))
                await release.wait()
                writer.write(OK)
                await writer.drain()
        finally:
            open_now -= 1

    server = await serve(handler)
    pool = UpstreamPool(max_open_per_worker=2)
    tasks = [asyncio.create_task(send(pool, server)) for _ in range(6)]
    await wait_until(lambda: slots(pool, server) == 6 and len(server.requests) == 2)
    assert server.connections == 2 and len(server.requests) == 2  # the other four wait for a slot
    release.set()
    replies = await asyncio.gather(*tasks)
    assert all(r.status == 200 for r in replies) and len(server.requests) == 6
    assert server.connections == 2 and peak == 2  # waiters reused the two connections

    # A request that finds every slot busy for longer than its connect_s gets UpstreamBusy.
    release.clear()
    held = [asyncio.create_task(send(pool, server)) for _ in range(2)]
    await wait_until(lambda: len(server.requests) == 8)
    with pytest.raises(UpstreamBusy, match="all 2 connections") as info:
        await pool.post("127.0.0.1", server.port, post(), connect_s=0.1, read_s=2.0, total_s=5.0)
    assert info.value.timed_out and not info.value.answered
    # A waiter cancelled by its client leaves no trace: it neither takes nor blocks a slot.
    gone = asyncio.create_task(pool.post("127.0.0.1", server.port, post(), connect_s=5, read_s=2, total_s=5))
    await wait_until(lambda: slots(pool, server) == 3)  # queued behind the two held requests
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    release.set()
    await asyncio.gather(*held)
    assert pool._slots == {}  # nothing kept for a worker without requests
    assert (await send(pool, server)).status == 200  # the full set of slots is back
    assert server.connections == 2
    pool.close()


def test_direct_addresses() -> None:
    assert direct_address("http://10.0.0.7:8000") is not None
    address = direct_address("http://10.0.0.7:8000")
    assert address is not None and (address.host, address.port, address.host_header) == (
        "10.0.0.7",
        8000,
        b"10.0.0.7:8000",
    )
    assert direct_address("http://[::1]:9") is not None
    assert direct_address("https://10.0.0.7:8000") is None  # TLS stays with aiohttp
    assert direct_address("http://10.0.0.7:8000/prefix") is None
