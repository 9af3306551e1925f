"""A lean HTTP/1.1 client for the hot path's POSTs to plain-HTTP workers.

aiohttp's request machinery (header multidicts, payload objects, tracing hooks, timer contexts)
was the largest single share of the gateway's CPU per request. A non-streamed completion needs
far less: write one prebuilt request, parse the answer with httptools (the C parser uvicorn uses),
hand back status, content type and body. Connections are kept alive and pooled per worker; an
idle connection the worker has closed is noticed (`connection_lost`) and never reused, and a
request that fails on a reused connection before any answer byte is sent once more on a fresh
connection (the worker closed an idle keep-alive connection; it never saw the request).

Open connections per worker are capped at `max_open_per_worker` whatever the pool's
`max_in_flight_per_worker` says (it may be null): each request holds one slot for its whole
exchange, and a new connection is opened only when no idle one is left, so open connections never
exceed the number of slots. A request that finds every slot busy waits up to its `connect_s`,
then fails with `UpstreamBusy` (the gateway answers 503 if no other worker takes it). Slots and
the timeout sweep live in `upstream_slots.py`.

Streamed answers come through `open_stream`: the head first, then the body as it arrives, read
from a bounded buffer (the connection stops reading from the worker while the reader lags).
Whole answers (read in one call, or by `read_whole` from a stream) are held within the process's
`AnswerBudget` (through the request's tenant share, `hold`), shared with aiohttp's whole reads;
a whole answer's `Reservation` goes with it to the client's response, which gives it back once
the answer has been written.
https workers and everything off the hot path keep using aiohttp. The connection itself is in
`upstream_conn.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway import upstream_conn
from gateway.answer_budget import AnswerBudget, AnswerHold, Reservation, TenantShare
from gateway.stream_body import DEFAULT_STREAM_BUFFER_BYTES, StreamBuffers
from gateway.upstream_conn import (
    MAX_ANSWER_BYTES,
    AnswerBody,
    AnswerBudgetExceeded,
    AnswerTimeLimit,
    AnswerTooLarge,
    RetryHints,
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamError,
    UpstreamHead,
    UpstreamReply,
    UpstreamTimeout,
    WorkerConnection,
)
from gateway.upstream_slots import ConnectionSlots, TimeoutSweep, done_within

T = TypeVar("T")

# `limits.max_buffered_answer_bytes`' default: eight answers at the per-answer cap.
DEFAULT_BUDGET_BYTES = 8 * MAX_ANSWER_BYTES

__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_STREAM_BUFFER_BYTES",
    "MAX_ANSWER_BYTES",
    "AnswerBody",
    "AnswerBudget",
    "AnswerBudgetExceeded",
    "AnswerHold",
    "AnswerTimeLimit",
    "AnswerTooLarge",
    "Reservation",
    "RetryHints",
    "StreamBuffers",
    "TenantShare",
    "UpstreamBusy",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamReply",
    "UpstreamStream",
    "UpstreamTimeout",
    "read_reserved",
    "read_whole",
    "request_bytes",
]


class UpstreamPool:
    """Keep-alive connections to plain-HTTP workers: at most `max_open_per_worker` open (busy or
    idle) and `max_idle_per_worker` idle each. Whole answers are read within `budget` (the
    process's, shared with the aiohttp transport; one of its own when none is given). Read and
    total timeouts are checked by `sweep` (one of its own, on the loop's clock, when none is
    given)."""

    def __init__(
        self,
        max_idle_per_worker: int = 256,
        keepalive_timeout_s: float = 30.0,
        max_open_per_worker: int = 256,
        budget: AnswerBudget | None = None,
        streams: StreamBuffers | None = None,
        sweep: TimeoutSweep | None = None,
    ) -> None:
        self.budget = budget if budget is not None else AnswerBudget(DEFAULT_BUDGET_BYTES)
        self.streams = streams if streams is not None else StreamBuffers(DEFAULT_STREAM_BUFFER_BYTES)
        self._idle: dict[tuple[str, int], deque[WorkerConnection]] = {}
        self._max_idle = max_idle_per_worker
        self._keepalive_s = keepalive_timeout_s
        self._max_open = max_open_per_worker
        # Slots of the workers with a request in flight, dropped when the last user leaves
        # (workers come and go with discovery: the dict must not grow with every address seen).
        self._slots: dict[tuple[str, int], ConnectionSlots] = {}
        self._sweep = sweep if sweep is not None else TimeoutSweep()
        self._closed = False

    async def post(
        self,
        host: str,
        port: int,
        request: bytes,
        *,
        connect_s: float,
        read_s: float,
        total_s: float,
        hold: AnswerHold | None = None,
    ) -> UpstreamReply:
        """Send one prebuilt request (head and body) and return the whole answer, its bytes
        reserved from `hold` (the request's tenant share; the pool's budget alone when None)
        until the caller releases the reply (`UpstreamReply.release`)."""
        key = (host, port)
        slots = await self._enter(key, connect_s)
        try:
            _, reply = await self._on_a_connection(
                key, host, port, connect_s, lambda c: self._run(key, c, request, read_s, total_s, hold)
            )
            return reply
        finally:
            self._leave(key, slots)

    async def open_stream(
        self,
        host: str,
        port: int,
        request: bytes,
        *,
        connect_s: float,
        read_s: float,
        total_s: float,
        hold: AnswerHold | None = None,
    ) -> UpstreamStream:
        """Send one prebuilt request and return its answer's head; the body is read from the
        returned stream, which holds the connection (and its slot) until released or closed.
        `read_all` reserves from `hold` (as `post`)."""
        key = (host, port)
        slots = await self._enter(key, connect_s)
        try:
            conn, head = await self._on_a_connection(
                key, host, port, connect_s, lambda c: self._open(c, request, read_s, total_s)
            )
        except BaseException:
            self._leave(key, slots)
            raise
        return UpstreamStream(self, key, slots, conn, head, hold if hold is not None else self.budget)

    async def _on_a_connection(
        self,
        key: tuple[str, int],
        host: str,
        port: int,
        connect_s: float,
        send: Callable[[WorkerConnection], Awaitable[T]],
    ) -> tuple[WorkerConnection, T]:
        """`send` on an idle connection if there is one, else (or if the worker had closed it and
        so never saw the request) on a new one."""
        conn = self._take(key)
        if conn is not None:
            try:
                return conn, await send(conn)
            except UpstreamError as exc:
                if exc.answered or isinstance(exc, UpstreamTimeout):
                    raise
        conn = await self._connect(host, port, connect_s)
        return conn, await send(conn)

    async def _open(
        self, conn: WorkerConnection, request: bytes, read_s: float, total_s: float
    ) -> UpstreamHead:
        try:
            return await conn.stream(request, read_s, total_s)
        except (asyncio.CancelledError, UpstreamError):
            conn.abort()
            raise

    async def _enter(self, key: tuple[str, int], connect_s: float) -> ConnectionSlots:
        """Take one of the worker's connection slots (waiting up to `connect_s` for one)."""
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = ConnectionSlots(self._max_open)
        slots.users += 1
        if slots.take():
            return slots
        try:
            await slots.wait(connect_s)
        except BaseException as exc:
            self._forget(key, slots)
            if isinstance(exc, TimeoutError):
                raise UpstreamBusy(f"all {slots.capacity} connections to the worker stayed busy") from None
            raise
        return slots

    def _leave(self, key: tuple[str, int], slots: ConnectionSlots) -> None:
        slots.give()
        self._forget(key, slots)

    def _forget(self, key: tuple[str, int], slots: ConnectionSlots) -> None:
        slots.users -= 1
        if not slots.users and self._slots.get(key) is slots:
            del self._slots[key]

    async def _run(
        self,
        key: tuple[str, int],
        conn: WorkerConnection,
        request: bytes,
        read_s: float,
        total_s: float,
        hold: AnswerHold | None,
    ) -> UpstreamReply:
        answer = conn.request(request, read_s, total_s, hold)
        try:
            reply = await answer
        except (asyncio.CancelledError, UpstreamError):
            conn.abort()
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                answer.result().release()  # cancelled just after the answer came: nobody takes it
            raise
        self._give_back(key, conn)
        return reply

    async def _connect(self, host: str, port: int, connect_s: float) -> WorkerConnection:
        loop = asyncio.get_running_loop()
        connecting = asyncio.ensure_future(
            loop.create_connection(
                lambda: WorkerConnection(loop, self._sweep, self.budget, self.streams), host, port
            )
        )
        try:
            if not await done_within(connecting, connect_s):
                raise UpstreamConnectError("connect timed out", timed_out=True)
            _, protocol = connecting.result()
        except OSError as exc:
            raise UpstreamConnectError(f"connect failed ({type(exc).__name__})", timed_out=False) from None
        except BaseException:
            # Cancelled (the client left) or timed out just as the connect was made: nobody takes
            # the connection, so it is closed here.
            if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
                connecting.result()[0].abort()
            raise
        finally:
            connecting.cancel()  # (a no-op once it is done)
        return protocol

    def _take(self, key: tuple[str, int]) -> WorkerConnection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        horizon = time.monotonic() - self._keepalive_s
        while idle:
            conn = idle.pop()  # most recently used first: the least likely to have been closed
            if conn.alive and conn.idle_since_s >= horizon:
                return conn
            conn.abort()
        return None

    def _give_back(self, key: tuple[str, int], conn: WorkerConnection) -> None:
        if not conn.alive or self._closed:
            conn.abort()
            return
        idle = self._idle.get(key)
        if idle is None:
            # A worker address not seen idle before: workers come and go (discovery, pod IPs), so
            # the addresses left with nothing usable idle are dropped first, and the map holds
            # the workers in use rather than every address ever seen.
            self._sweep_idle()
            idle = self._idle[key] = deque()
        if len(idle) >= self._max_idle:
            conn.abort()
            return
        conn.idle_since_s = time.monotonic()
        idle.append(conn)

    def _sweep_idle(self) -> None:
        """Close the idle connections the worker closed or that outlived the keep-alive, oldest
        first, and forget the addresses left with none."""
        horizon = time.monotonic() - self._keepalive_s
        for key, idle in list(self._idle.items()):
            while idle and not (idle[0].alive and idle[0].idle_since_s >= horizon):
                idle.popleft().abort()
            if not idle:
                del self._idle[key]

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


class UpstreamStream:
    """A streamed answer from the lean client: `status` and `content_type`, then `read()` until
    it returns b"". `release()` after the end gives the connection back to the pool; `close()`
    (any time) drops it, so the worker stops. Either frees the connection slot, once."""

    __slots__ = (
        "_conn",
        "_done",
        "_hold",
        "_key",
        "_pool",
        "_slots",
        "content_type",
        "retry_hints",
        "status",
    )

    def __init__(
        self,
        pool: UpstreamPool,
        key: tuple[str, int],
        slots: ConnectionSlots,
        conn: WorkerConnection,
        head: UpstreamHead,
        hold: AnswerHold,
    ) -> None:
        self._pool = pool
        self._hold = hold
        self._key = key
        self._slots = slots
        self._conn = conn
        self._done = False
        self.status = head.status
        self.content_type = head.content_type
        self.retry_hints = head.retry_hints

    async def read(self) -> bytes:
        """The bytes that arrived since the last read (waiting for some); b"" at the end."""
        return await self._conn.body.read()

    async def read_all(self) -> bytes:
        """The rest of the answer (for a worker that did not stream, e.g. a 4xx)."""
        return await read_whole(self.read, self._hold)

    async def read_held(self, held: Reservation) -> AnswerBody:
        """The rest of the answer, its bytes kept reserved in `held` for the caller to release."""
        return await read_reserved(self.read, held)

    def release(self) -> None:
        """The answer was read to its end: the connection may serve another request."""
        if self._done:
            return
        self._done = True
        self._conn.body.discard()
        if self._conn.body.eof:
            self._pool._give_back(self._key, self._conn)
        else:
            self._conn.abort()
        self._pool._leave(self._key, self._slots)

    def close(self) -> None:
        """Drop the connection (the client left, the gateway drains, or the stream failed)."""
        if self._done:
            return
        self._done = True
        self._conn.abort()  # its unread bytes are given back
        self._pool._leave(self._key, self._slots)


async def read_whole(
    read: Callable[[], Awaitable[bytes]], budget: AnswerHold, limit: int | None = None
) -> bytes:
    """`read_reserved` whose reservation is released when the read ends, however it ends: for
    answers read for the gateway itself (render, a prefill leg) or passed on in another form."""
    held = Reservation(budget)
    try:
        body = await read_reserved(read, held, limit)
    finally:
        held.release()
    return body if isinstance(body, bytes) else bytes(body)


async def read_reserved(
    read: Callable[[], Awaitable[bytes]], held: Reservation, limit: int | None = None
) -> AnswerBody:
    """Everything `read` returns until b"", held whole, so bounded like the lean client's whole
    answers (`limit`, by default `MAX_ANSWER_BYTES` read when called): past it, `AnswerTooLarge`
    (the request asked for more than one answer may hold: no worker's fault, and no other worker
    would answer less);
    past the process's budget or the tenant's share of it (`held.hold`), `AnswerBudgetExceeded`.
    The bytes stay reserved in `held` for the caller to release; a read that fails releases them
    itself. Both transports' `read_all` go through here, so an https worker is held to the same
    bounds as an http one. The answer grows in one buffer, as in the lean client (and for the
    same reason: `upstream_conn`)."""
    if limit is None:
        limit = upstream_conn.MAX_ANSWER_BYTES
    body: AnswerBody = b""
    try:
        while data := await read():
            if len(body) + len(data) > limit:
                raise AnswerTooLarge()
            if not held.take(len(data)):
                raise AnswerBudgetExceeded(held.hold, len(data))
            body = upstream_conn.gather(body, data)
        return body
    except BaseException:
        held.release()
        raise


def request_bytes(host_header: bytes, path: bytes, headers: bytes, body: bytes) -> bytes:
    """One HTTP/1.1 POST: `headers` are complete `Name: value\\r\\n` lines."""
    return b"".join(
        (
            b"POST ",
            path,
            b" HTTP/1.1\r\nHost: ",
            host_header,
            b"\r\n",
            headers,
            b"Content-Length: ",
            str(len(body)).encode(),
            b"\r\n\r\n",
            body,
        )
    )
