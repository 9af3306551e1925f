"""How a client connection ends while its client may still be sending: a lingering close.

A TCP socket closed with unread bytes in its receive buffer is reset (RST) rather than closed
with a FIN, and the reset throws away what the socket had not sent yet: answers the gateway
already wrote never reach the client (RFC 9112, 9.6, "tear-down"). A client pipelining past
`MAX_PIPELINED` behind a small receive window got only its first 10 of 17 answers this way; one
still sending a body the gateway refused meets the reset on its next write, and most clients then
give up without reading the error waiting for them.

So such a connection ends as nginx's `lingering_close` ends it: the last answer is written, the
sending side shut (`write_eof`; the FIN goes out once the transport's buffer has drained, after
the last answer), and whatever the client still sends is read and dropped, neither parsed nor
kept, until the client closes (the connection is then closed at once), `LINGER_S` have passed or
more than `LINGER_BYTES` have been dropped; then it is closed. A client that has stopped sending
by then leaves nothing unread, so the close sends no reset and the kernel delivers what is still
queued. A lingering connection counts against the connection limits (the process's and its
address's) until it is closed, like any other. Bytes read while answers owed are still being
written are dropped and counted too; past `LINGER_BYTES` reading stops, and the connection is
closed outright once they are written. The linger's deadline is a timer: one per lingering
connection, never one per request.

`GuardedHttpToolsProtocol` (`http_limits`) lingers where input may be left unread after its last
answer: past the pipelining bound, after a refused head or body (431, 408, 400, 501), and after an
answer given before its request's body was read (a 401, 413 or 429 decided from the headers) when
the client asked to close (`connection: close`, HTTP/1.0) or may never send that body: it asked
for `100 Continue` and got none (`close_if_body_withheld`). Any other close stays a plain close,
and a client that reads nothing is still aborted at `send_timeout_s`.

An early answer otherwise keeps the connection: its client goes on sending the body it announced,
which is read and dropped (as nginx discards one), and the next request is served. A client
waiting for `100 Continue` may instead skip the body after a final answer (RFC 9110, 10.1.1) and
send its next request: read as the body, that request would go unanswered until `body_timeout_s`
closed the connection. So that answer carries `connection: close` and ends in a linger, which
drops the body if the client sends it after all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

if TYPE_CHECKING:
    from uvicorn._types import ASGISendEvent

# How long a lingering connection reads on (Apache httpd's short lingering close, meant against
# denial of service, waits 2 s; its normal one and nginx's `lingering_time` 30 s), and how much
# it drops before it closes regardless (neither server bounds it): one body at the default
# `limits.max_body_bytes`, so that a client refused from its headers (401, 413, 429) can send the
# rest of its body and then read the error, while a client flooding a refused head makes the
# gateway read 8 MiB more at most (a few milliseconds of CPU), not all it can send in `LINGER_S`.
LINGER_S = 2.0
LINGER_BYTES = 8 * 1024 * 1024


class CloseInstead(asyncio.Transport):
    """A connection's transport as one request's cycle sees it: writes go through, and the close
    uvicorn makes after an answer with `connection: close` calls `on_close` instead."""

    def __init__(self, transport: asyncio.Transport, on_close: Callable[[], None]) -> None:
        super().__init__()
        self._transport = transport
        self._on_close = on_close

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._on_close()


def close_if_body_withheld(cycle: RequestResponseCycle, on_close: Callable[[], None]) -> None:
    """`cycle`'s client asked for `100 Continue` before sending its body: if its answer starts with
    no `100 Continue` written and the body not read whole, the answer carries `connection: close`
    and uvicorn's close after it calls `on_close` (a linger) instead (see the module docstring).
    Wraps the cycle's `send`: only such requests pay for it."""
    send = cycle.send

    async def send_deciding_keep_alive(message: ASGISendEvent) -> None:
        # uvicorn clears `waiting_for_100_continue` once it writes the 100 or the answer's head,
        # and `more_body` once the request's body has been parsed to its end.
        if cycle.waiting_for_100_continue and cycle.more_body and not cycle.response_started:
            cycle.keep_alive = False  # uvicorn adds `connection: close` and closes after the answer
            if not isinstance(cycle.transport, CloseInstead):
                cycle.transport = CloseInstead(cycle.transport, on_close)
        await send(message)

    cycle.send = send_deciding_keep_alive  # type: ignore[method-assign]


class LingeringHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a lingering close (see the module docstring). Its subclass
    ends a connection with `_end_after_answers` or `_end_refused` (or `_linger` once the last
    answer is written) and hands every byte read after that to `_drop`; it takes the connection
    off any deadline of its own first (the linger keeps its own)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._ending = False  # nothing more is parsed: answer what was taken, then linger
        self._dropped_bytes = 0  # read since, and dropped
        self._lingering = False
        self._linger_deadline: asyncio.TimerHandle | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_deadline is not None:  # what it would close is gone
            self._linger_deadline.cancel()
            self._linger_deadline = None
        super().connection_lost(exc)

    def _close_when_sent(self) -> None:
        """Close the connection once the answers still buffered have been sent (a subclass bounds
        how long a client that reads none of them may take)."""
        self.transport.close()

    def _drop(self, size: int) -> None:
        """`size` bytes read after the parser stopped: dropped, and counted against `LINGER_BYTES`."""
        self._dropped_bytes += size
        if self._dropped_bytes > LINGER_BYTES:
            if self._lingering:
                self._close_when_sent()
            else:  # answers are still owed: read no more until they are written
                self.flow.pause_reading()

    def _end_after_answers(self, last: RequestResponseCycle | None) -> None:
        """Parse nothing more: the requests taken are answered, `last` (the newest of them) with
        `connection: close`, and the connection lingers after that answer. None: the last is the
        answer under way, which uvicorn keeps no reference to; it goes out as it is, and the
        subclass lingers once it is complete (with no request left in the pipeline)."""
        self._ending = True
        self.flow.pause_reading()
        if last is None:
            return
        if last.response_complete:
            self._linger()
            return
        last.keep_alive = False  # uvicorn adds `connection: close` and closes after it: a linger
        last.transport = CloseInstead(self.transport, self._linger)

    def _end_refused(self, answer: bytes, body_refused: bool) -> None:
        """End the connection on a refused request: write `answer` (its error) unless another answer
        is under way, and linger. With `body_refused` the refused request is the newest cycle;
        otherwise it has none yet, and the newest cycle is the request before it. That cycle, if
        its answer is not complete, sees the client leave (its `receive` returns `http.disconnect`)
        and anything it sends is dropped. Requests queued behind an earlier answer still being
        written are dropped unanswered, and the connection lingers once that answer is complete:
        uvicorn keeps no reference to it, so it cannot be told the client left."""
        cycle = self.cycle
        write = not cycle.response_started if body_refused else (cycle is None or cycle.response_complete)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if self.pipeline:
            self.pipeline.clear()
            self._end_after_answers(None)
            return
        if write and not self.transport.is_closing():
            self.transport.write(answer)
        self._linger()

    def _linger(self) -> None:
        """The last answer is written: shut the sending side once it has left, drop what the client
        still sends, and close at the first bound (see the module docstring)."""
        transport = self.transport
        if self._lingering or transport.is_closing():
            return
        self._ending = True
        self._lingering = True
        # Requests parsed after an answer with `connection: close` are not answered (nor were
        # they when uvicorn closed outright).
        self.pipeline.clear()
        if self.cycle is not None:
            # A request still waiting to read its body gets no `100 Continue` after the FIN: its
            # `receive` would write it first (uvloop refuses a write after `write_eof`).
            self.cycle.waiting_for_100_continue = False
        if self._dropped_bytes > LINGER_BYTES:
            self._close_when_sent()
            return
        transport.write_eof()
        self.flow.resume_reading()
        self._linger_deadline = self.loop.call_later(LINGER_S, self._close_when_sent)
