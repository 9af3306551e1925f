"""Hostile-client probes against a running gateway, over raw sockets on loopback.

Each probe opens its connections as an attacker would and holds them until the server closes them
or the probe's own time is up, then reports, per connection, the status the server answered (if
any) and how long after opening it closed the connection:

- `unfinished_headers`: a request head that never ends, `header_bytes` long (the server should
  answer 431 and close once its header limit is passed, holding little memory meanwhile);
- `slow_headers`: a request head sent one byte at a time (slowloris; 408 and close at the header
  deadline);
- `partial_bodies`: a complete, authenticated head announcing a body of which only part is sent
  (the request may take its tenant's slot, then the body deadline closes it).

The end-to-end tests run them with a few connections against short deadlines; a reliability
bench can run the same probes at full size.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import orjson

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What the server did to one probe connection."""

    status: int | None  # the status of the response it sent, if any
    closed_after_s: float | None  # from opening to the server's close; None: still open at the end
    sent_bytes: int


@dataclass(frozen=True, slots=True)
class Target:
    """Where the probes connect."""

    host: str
    port: int


class _Conn:
    """One probe connection: a writer the probe drives, and a reader task that notes the
    response status and the moment the server closes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.opened_s = time.monotonic()
        self.closed_s: float | None = None
        self.status: int | None = None
        self.sent = 0
        self.closed = asyncio.Event()
        self._reader_task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        received = b""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if self.status is None:
                    received += data
                    line, found, _ = received.partition(b"\r\n")
                    if found:
                        parts = line.split()
                        if len(parts) >= 2 and parts[1].isdigit():
                            self.status = int(parts[1])
        except (ConnectionError, OSError):
            pass
        self.closed_s = time.monotonic()
        self.closed.set()

    async def send(self, data: bytes) -> bool:
        """Send `data`; False once the server has closed the connection."""
        if self.closed.is_set():
            return False
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            return False
        self.sent += len(data)
        return True

    async def close(self) -> ProbeResult:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
        after = None if self.closed_s is None else self.closed_s - self.opened_s
        return ProbeResult(self.status, after, self.sent)


async def _open(target: Target) -> _Conn:
    reader, writer = await asyncio.open_connection(target.host, target.port)
    return _Conn(reader, writer)


Drive = Callable[[_Conn], Coroutine[Any, Any, None]]


async def _run(target: Target, connections: int, drive: Drive, timeout_s: float) -> list[ProbeResult]:
    """Open `connections` connections, drive each from the moment it is open (the server's header
    deadline starts at its accept: a connection left waiting for the others to open could be
    closed as silent), and wait until the server closed them all or `timeout_s` passed; then close
    what is left."""
    conns: list[_Conn] = []
    drivers: list[asyncio.Task[None]] = []
    for _ in range(connections):
        conns.append(await _open(target))
        drivers.append(asyncio.create_task(drive(conns[-1])))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(c.closed.wait() for c in conns)), timeout_s)
    for task in drivers:
        task.cancel()
    await asyncio.gather(*drivers, return_exceptions=True)
    return [await c.close() for c in conns]


def _head_start(target: Target, path: str = CHAT_PATH) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n".encode()


async def unfinished_headers(
    target: Target, *, connections: int, header_bytes: int, chunk_bytes: int = 64 * 1024, timeout_s: float
) -> list[ProbeResult]:
    """Each connection sends a request head of `header_bytes` (one huge header field) that never
    ends, then waits."""
    head = _head_start(target) + b"X-Fill: "
    chunk = b"a" * chunk_bytes

    async def drive(conn: _Conn) -> None:
        if not await conn.send(head):
            return
        left = header_bytes - len(head)
        while left > 0:
            if not await conn.send(chunk[: min(left, chunk_bytes)]):
                return
            left -= chunk_bytes
        # Never the blank line that ends the head: the connection is held until the server acts.

    return await _run(target, connections, drive, timeout_s)


async def slow_headers(
    target: Target, *, connections: int, interval_s: float = 1.0, timeout_s: float
) -> list[ProbeResult]:
    """Each connection sends its request head one byte every `interval_s`, forever (slowloris)."""
    head = _head_start(target, "/v1/models") + b"X-Slow: "

    async def drive(conn: _Conn) -> None:
        i = 0
        while await conn.send(head[i : i + 1] if i < len(head) else b"a"):
            i += 1
            await asyncio.sleep(interval_s)

    return await _run(target, connections, drive, timeout_s)


async def partial_bodies(
    target: Target,
    *,
    connections: int,
    api_key: str,
    model: str,
    sent_fraction: float = 0.5,
    timeout_s: float,
    started: asyncio.Event | None = None,
) -> list[ProbeResult]:
    """Each connection sends an authenticated chat request's head and `sent_fraction` of its
    body, then waits. `started` is set once every connection has sent what it will send."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "x" * 1000}]})
    head = (
        _head_start(target)
        + (
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
    )
    sent = head + body[: int(len(body) * sent_fraction)]
    remaining = connections

    async def drive(conn: _Conn) -> None:
        nonlocal remaining
        await conn.send(sent)
        remaining -= 1
        if remaining == 0 and started is not None:
            started.set()

    return await _run(target, connections, drive, timeout_s)
