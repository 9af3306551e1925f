"""A lean HTTP/1.1 client for the hot path's non-streamed POSTs to plain-HTTP workers.

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

Streamed requests, https workers and everything off the hot path keep using aiohttp.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import cast

import httptools

from gateway.upstream_slots import ConnectionSlots, TimeoutSweep
from policies.records import record

# A non-streamed answer is held whole before it is relayed: bound it (a chat completion with many
# choices and logprobs stays far below this).
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class UpstreamError(Exception):
    """The request did not produce a complete answer. `answered` is True when the worker had
    started answering (response bytes arrived), so the request must not be retried elsewhere."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class UpstreamConnectError(UpstreamError):
    """No connection (refused, unreachable, or the connect timed out)."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message, answered=False)
        self.timed_out = timed_out


class UpstreamBusy(UpstreamConnectError):
    """Every connection slot to the worker stayed busy for the whole connect timeout."""

    def __init__(self, message: str) -> None:
        super().__init__(message, timed_out=True)


class UpstreamTimeout(UpstreamError):
    """The worker was silent for longer than the read timeout (or the total timeout passed)."""


@record
class UpstreamReply:
    """A complete non-streamed answer."""

    status: int
    content_type: str
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    __slots__ = (
        "_body",
        "_content_type",
        "_deadline_s",
        "_done",
        "_header_name",
        "_last_activity_s",
        "_loop",
        "_parser",
        "_read_s",
        "_size",
        "_sweep",
        "alive",
        "got_bytes",
        "idle_since_s",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, sweep: TimeoutSweep) -> None:
        self._loop = loop
        self._sweep = sweep
        self.transport: asyncio.Transport | None = None
        self.alive = False
        self.idle_since_s = 0.0
        self._done: asyncio.Future[UpstreamReply] | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._body: list[bytes] = []
        self._size = 0
        self._content_type = ""
        self._header_name = b""
        self._read_s = 0.0
        self._deadline_s = 0.0
        self._last_activity_s = 0.0
        self.got_bytes = False

    # asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have the same interface.
        self.transport = cast(asyncio.Transport, transport)
        self.alive = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        self._fail(UpstreamError("worker closed the connection", answered=self.got_bytes))

    def data_received(self, data: bytes) -> None:
        if self._parser is None:
            self.alive = False  # bytes nobody asked for: the connection is unusable
            self._close()
            return
        self.got_bytes = True
        self._last_activity_s = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("worker tried to upgrade the connection", answered=True))
        except httptools.HttpParserError:
            self._fail(UpstreamError("worker sent a malformed answer", answered=True))

    # httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._content_type = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_ANSWER_BYTES:
            self.alive = False
            self._fail(UpstreamError("worker answer too large", answered=True))
            self._close()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        done = self._done
        if parser is None or done is None:
            return
        keep = parser.should_keep_alive()
        reply = UpstreamReply(parser.get_status_code(), self._content_type, b"".join(self._body))
        self._reset()
        if not keep:
            self.alive = False
            self._close()
        if not done.done():
            done.set_result(reply)

    # requests --------------------------------------------------------------------------------
    def request(self, data: bytes, read_s: float, total_s: float) -> asyncio.Future[UpstreamReply]:
        assert self.transport is not None
        self._done = self._loop.create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._body = []
        self._size = 0
        self._content_type = ""
        self.got_bytes = False
        now = self._loop.time()
        self._read_s = read_s
        self._deadline_s = now + total_s
        self._last_activity_s = now
        self._sweep.add(self)
        self.transport.write(data)
        return self._done

    def check_timeout(self, now: float) -> None:
        """Fail the request if the worker has been silent for `read_s`, or `total_s` has passed."""
        if now < min(self._last_activity_s + self._read_s, self._deadline_s):
            return
        self.alive = False
        answered = self.got_bytes
        self._fail(UpstreamTimeout("worker timed out", answered=answered))
        self._close()

    def abort(self) -> None:
        """The caller gave up (client disconnect): drop the connection so the worker stops."""
        self.alive = False
        self._reset()
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: UpstreamError) -> None:
        done = self._done
        self._reset()
        if done is not None and not done.done():
            done.set_exception(exc)

    def _reset(self) -> None:
        self._sweep.discard(self)
        self._parser = None
        self._done = None

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Keep-alive connections to plain-HTTP workers: at most `max_open_per_worker` open (busy or
    idle) and `max_idle_per_worker` idle each."""

    def __init__(
        self,
        max_idle_per_worker: int = 256,
        keepalive_timeout_s: float = 30.0,
        max_open_per_worker: int = 256,
    ) -> None:
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._max_idle = max_idle_per_worker
        self._keepalive_s = keepalive_timeout_s
        self._max_open = max_open_per_worker
        # Slots of the workers with a request in flight, dropped when the last user leaves
        # (workers come and go with discovery: the dict must not grow with every address seen).
        self._slots: dict[tuple[str, int], ConnectionSlots] = {}
        self._sweep = TimeoutSweep()
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
    ) -> UpstreamReply:
        """Send one prebuilt request (head and body) and return the whole answer."""
        key = (host, port)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = ConnectionSlots(self._max_open)
        slots.users += 1
        try:
            if not slots.take():
                try:
                    await slots.wait(connect_s)
                except TimeoutError:
                    raise UpstreamBusy(
                        f"all {slots.capacity} connections to the worker stayed busy"
                    ) from None
            try:
                return await self._exchange(key, host, port, request, connect_s, read_s, total_s)
            finally:
                slots.give()
        finally:
            slots.users -= 1
            if not slots.users:
                del self._slots[key]

    async def _exchange(
        self,
        key: tuple[str, int],
        host: str,
        port: int,
        request: bytes,
        connect_s: float,
        read_s: float,
        total_s: float,
    ) -> UpstreamReply:
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._run(key, conn, request, read_s, total_s)
            except UpstreamError as exc:
                if exc.answered or isinstance(exc, UpstreamTimeout):
                    raise
                # A reused connection the worker had closed: it never saw this request.
        conn = await self._connect(host, port, connect_s)
        return await self._run(key, conn, request, read_s, total_s)

    async def _run(
        self, key: tuple[str, int], conn: _Connection, request: bytes, read_s: float, total_s: float
    ) -> UpstreamReply:
        try:
            reply = await conn.request(request, read_s, total_s)
        except (asyncio.CancelledError, UpstreamError):
            conn.abort()
            raise
        self._give_back(key, conn)
        return reply

    async def _connect(self, host: str, port: int, connect_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, protocol = await loop.create_connection(lambda: _Connection(loop, self._sweep), host, port)
        except TimeoutError:
            raise UpstreamConnectError("connect timed out", timed_out=True) from None
        except OSError as exc:
            raise UpstreamConnectError(f"connect failed ({type(exc).__name__})", timed_out=False) from None
        return protocol

    def _take(self, key: tuple[str, int]) -> _Connection | None:
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

    def _give_back(self, key: tuple[str, int], conn: _Connection) -> None:
        if not conn.alive or self._closed:
            conn.abort()
            return
        idle = self._idle.setdefault(key, deque())
        if len(idle) >= self._max_idle:
            conn.abort()
            return
        conn.idle_since_s = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


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
