"""The lean upstream client's connect timeout counts the time this process ran, not its stalls."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from gateway.upstream import UpstreamConnectError, UpstreamPool
from gateway.upstream_slots import done_within


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A socket on 127.0.0.1 that listens and never accepts: the kernel completes connects to
    it (up to its backlog), as a worker's would be before its server reads them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock
    sock.close()


async def test_a_connect_the_worker_accepted_while_this_process_stalled_is_not_its_timeout(
    listening: socket.socket,
) -> None:
    """The connect starts, then this process stops for longer than the connect timeout (a long
    garbage collection, a starved machine) while the kernel completes the connect. When the loop
    runs again, the timer is due before the socket is read: the connect must still succeed, as
    the worker was not slow."""
    pool = UpstreamPool()
    port = listening.getsockname()[1]
    connecting = asyncio.create_task(pool._connect("127.0.0.1", port, 0.05))
    await asyncio.sleep(0)  # the connect has started
    time.sleep(0.3)  # noqa: ASYNC251 - this process stalls past the deadline (the loop does not run)
    conn = await connecting
    assert conn.alive
    conn.abort()
    pool.close()


async def test_a_future_that_never_completes_is_not_done_within_its_timeout() -> None:
    loop = asyncio.get_running_loop()
    assert await done_within(loop.create_future(), 0.01) is False
    done = loop.create_future()
    done.set_result(None)
    assert await done_within(done, 0.01) is True


async def test_a_connect_that_fails_is_an_error_not_a_timeout() -> None:
    pool = UpstreamPool()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: the connect is refused
        with pytest.raises(UpstreamConnectError) as refused:
            await pool._connect("127.0.0.1", port, 1.0)
    assert refused.value.timed_out is False
    pool.close()


async def test_a_connect_made_as_its_caller_is_cancelled_is_closed(listening: socket.socket) -> None:
    """The caller is cancelled (its client left) once the connect is made but before it resumes:
    the connection nobody takes is closed, not left open to the worker."""
    pool = UpstreamPool()
    made: list[asyncio.Transport] = []
    original = asyncio.get_running_loop().create_connection

    async def connect_then_cancel_caller(*args: object, **kwargs: object) -> tuple[asyncio.Transport, object]:
        transport, protocol = await original(*args, **kwargs)  # type: ignore[arg-type]
        made.append(transport)
        caller.cancel()  # before the caller's wait sees the connect done
        return transport, protocol

    loop = asyncio.get_running_loop()
    loop.create_connection = connect_then_cancel_caller  # type: ignore[method-assign]
    try:
        caller = asyncio.create_task(pool._connect("127.0.0.1", listening.getsockname()[1], 5.0))
        with pytest.raises(asyncio.CancelledError):
            await caller
    finally:
        del loop.create_connection
    assert made and made[0].is_closing()
    pool.close()
