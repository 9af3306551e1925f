"""A streamed answer's body between a worker connection and its reader, and the process's count
of the bytes such bodies hold unread (`limits.max_buffered_stream_bytes`).

The connection (`upstream_conn.WorkerConnection`) pushes what it parses; the reader (the relay)
takes at most `STREAM_READ_BYTES` at a time. Past a threshold of unread bytes the connection stops
reading from the worker (TCP then slows the worker down), and reads again once the reader has
taken enough; the threshold is lower while all streams together hold more than their budget.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.upstream_conn import UpstreamError


class Pausable(Protocol):
    """The connection side of a body: it stops and restarts reading from its worker."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


# A streamed answer's unread bytes above which the connection stops reading from the worker
# (TCP then slows the worker down), and below which it reads again; while the process's streams
# hold more than their budget (`StreamBuffers`), each stops past `STREAM_TIGHT_BYTES` instead.
STREAM_PAUSE_BYTES = 1024 * 1024
STREAM_RESUME_BYTES = 256 * 1024
STREAM_TIGHT_BYTES = 64 * 1024
# The most a reader takes at once (`StreamBody.read`).
STREAM_READ_BYTES = 64 * 1024
# `limits.max_buffered_stream_bytes`' default.
DEFAULT_STREAM_BUFFER_BYTES = 256 * 1024 * 1024


class StreamBuffers:
    """Unread bytes of streamed answers across the process: what workers sent that the relays
    have not yet taken, because their clients read slower than the workers write. Past
    `capacity_bytes` every stream stops reading from its worker once it holds
    `STREAM_TIGHT_BYTES` unread, instead of `STREAM_PAUSE_BYTES`: nothing is refused, the
    workers are slowed by TCP. So the process holds at most the capacity, plus one stream's
    `STREAM_PAUSE_BYTES` (the one that crossed it), plus per stream `STREAM_TIGHT_BYTES`, each
    stream past its threshold by at most one read of the socket, however many streams read slowly."""

    __slots__ = ("capacity_bytes", "held_bytes")

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0

    def pause_above(self) -> int:
        """The unread bytes past which a stream stops reading now."""
        return STREAM_TIGHT_BYTES if self.held_bytes > self.capacity_bytes else STREAM_PAUSE_BYTES


class StreamBody:
    """The body of a streamed answer between the connection (writer) and one reader. Its unread
    bytes are counted in the process's `StreamBuffers` until read or dropped (`discard`)."""

    __slots__ = ("_buffers", "_conn", "_waiter", "chunks", "eof", "error", "size")

    def __init__(self, conn: Pausable, buffers: StreamBuffers) -> None:
        self._conn = conn
        self._buffers = buffers
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.eof = False
        self.error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def push(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        buffers = self._buffers
        buffers.held_bytes += len(data)
        if self.size > buffers.pause_above():
            self._conn.pause()
        self._wake()

    def discard(self) -> None:
        """Nobody will read the rest (the stream was closed): give its bytes back."""
        self._buffers.held_bytes -= self.size
        self.size = 0
        self.chunks.clear()

    def end(self, error: UpstreamError | None = None) -> None:
        if error is not None:
            self.error = error
        else:
            self.eof = True
        self._wake()

    async def read(self) -> bytes:
        """What was received so far, at most `STREAM_READ_BYTES` of it (waiting for something);
        b"" at the end of the answer. The rest stays here, counted, so a reader that is slow to
        come back holds one piece, not everything that arrived meanwhile."""
        chunks = self.chunks
        while not chunks:
            if self.error is not None:
                raise self.error
            if self.eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.size <= STREAM_READ_BYTES:
            data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
        else:
            taken: list[bytes] = []
            left = STREAM_READ_BYTES
            while left > 0:
                first = chunks[0]
                if len(first) <= left:
                    taken.append(chunks.popleft())
                    left -= len(first)
                else:
                    taken.append(first[:left])
                    chunks[0] = first[left:]
                    left = 0
            data = b"".join(taken)
        self.size -= len(data)
        self._buffers.held_bytes -= len(data)
        self._conn.resume()
        return data

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
