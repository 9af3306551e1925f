"""Bounds on what a client controls before its request reaches the app: the size and number of its
header fields, the time it takes to send its headers and its body, how long it may keep an idle
connection, and how many connections the process holds.

uvicorn's httptools protocol bounds none of these but the keep-alive time (h11's
`h11_max_incomplete_event_size` covers only the h11 protocol). `GuardedHttpToolsProtocol` adds
them in a few hooks around httptools' parser callbacks; the parsing itself stays httptools'.

Deadlines are not timers. Each connection notes the deadline of the phase it is in; uvicorn's own
periodic tick (`DrainingServer.on_tick`, every 0.1 s) calls `ClientGuard.tick`, which closes the
connections past theirs. A timer armed and cancelled per request costs measurable CPU
(docs/benchmarks.md, "Gateway overhead"); this costs a few attribute writes per request, and the
keep-alive timer uvicorn armed after every response is gone too.

A connection's phases, and the deadline each one carries:

    IDLE  (between requests)           keepalive_timeout_s    expiry: close
    HEAD  (request line and headers)   header_timeout_s       expiry: 408 and close
    BODY  (headers done, body not)     body_timeout_s         expiry: 408 (or close) and close
    APP   (the app has the request)    none

Apart from the phases, a connection whose client stops reading has its writes paused by the
transport (its buffer above the high-water mark) and the response waits. If the buffer has not
drained when `send_timeout_s` has passed since the pause, the connection is aborted: what it
buffered is dropped, the response's sends return at once, and the request sees its client
leave (a stream's worker request is closed, a whole answer's budget given back). Only a client
that reads nothing for that long is cut off: each drain below the low-water mark restarts it.

How many connections the process holds is bounded (`max_client_connections`; capped connections
only, the metrics listener's are counted but never refused). A new connection that finds the table
full takes the place of one holding it without a request in the app: idle, still sending its head
or the body of a request already answered, or lingering after its last answer
(`http_guard.Evictable`). That one is closed (counted `evicted`): from the address holding the
most such connections, the one that has held its place so the longest. So a client that opens
connections and sends nothing, or sends its heads byte by byte, displaces its own connections,
not other clients'. A connection whose request the app has, or whose answer is being written, is
never taken; when every place is held so, the new connection is closed at once
(`connection_limit`). With `max_connections_per_address` set, one address past it is closed at
once too (`address_limit`).

A new connection starts in HEAD: it must send a request head in time. Either head limit answers
431 and closes. Header bytes are counted as they arrive, so that httptools never buffers a huge
head whole: a read that leaves the head unfinished counts whole. The read that finishes it is
measured only when it could reach the limit (a small head in one read, the common case, costs one
comparison): up to the blank line that ends the head, found with `bytes.find`, so body bytes never
count. A head that began after another request inside one read (pipelining) starts at an offset
httptools does not report; it is measured from its parsed parts, a lower bound that misses only
optional whitespace. The header fields are counted when the head is complete, and its `Host` and
`Transfer-Encoding` checked (`http_framing`: 400 or 501 and close).

Pipelined requests (sent before the previous answer) wait in a queue per connection, each with its
head and its body's bytes in that read. At most `MAX_PIPELINED` wait: a request beginning past them
is not read. The connection answers the ones it took, the last with `connection: close`, and
ends; a client that pipelines retries what was left unanswered (RFC 9112, 9.3.2). One read of
256 KiB would otherwise queue thousands of small requests, before any key is checked. There, and
wherever a connection ends with client bytes maybe unread, it ends with a lingering close
(`http_linger`), so that no reset throws its last answers away.

The limits, and the guard that holds the connections waiting on a deadline, are `http_guard`'s.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httptools
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.http_framing import UPGRADE_WITH_BODY, FramingCheck, has_body, refusal_response
from gateway.http_guard import GuardedServerState
from gateway.http_linger import CloseInstead, LingeringHttpToolsProtocol, close_if_body_withheld

# Where a connection is in its request cycle (see the module docstring). Plain ints, not an
# enum: the phase is read and written several times per request.
IDLE, HEAD, BODY, APP = 0, 1, 2, 3

# Requests a connection may have waiting behind the one being answered (see the module docstring).
MAX_PIPELINED = 16

_HEAD_END = b"\r\n\r\n"  # llhttp accepts no bare-LF line ends, so this alone ends a head
_REQUEST_START = re.compile(rb"[^\r\n]")  # blank lines before a request line are skipped


class _HeadRefused(Exception):
    """Raised from the header callback to stop httptools at once; carries the refusal's status,
    reason and message."""

    def __init__(self, reason: str, message: str, status: int = 431) -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.message = message
        self.status = status


class _PipelineFull(Exception):
    """Raised from the message callback to stop httptools at a request past `MAX_PIPELINED`."""


class GuardedHttpToolsProtocol(LingeringHttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `ClientLimits` (see the module docstring).
    Needs a `GuardedServerState`. An uncapped connection (the metrics listener's) is counted but
    never refused for the connection limit, so that a flood of clients cannot blind monitoring."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        capped: bool = True,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.capped = capped
        assert isinstance(server_state, GuardedServerState)
        self._guard = server_state.guard
        self._limits = server_state.guard.limits
        self._phase = HEAD
        self.deadline_s = 0.0
        self.send_deadline_s = 0.0  # while in the guard's `stalled`
        # Header bytes of the current head in earlier reads. Exact when the head began at a
        # known offset; a lower bound when it began after another request inside a read.
        self._head_bytes = 0
        self._chunk = b""  # the read being parsed, while it is
        self._message_ended_inside = False  # a request ended inside `_chunk`
        self._head_start_unknown = False  # the current head began after a request in its read
        self._head_tail = b""  # last bytes of the previous read of this head; b"" if it began in `_chunk`
        # The client's address while it holds a capped place (in the guard's `evictable` when it
        # has no request in the app, and counted in `by_address` under a per-address limit).
        self._address: str | None = None
        self._framing = FramingCheck()

    # -- phases

    def _wait(self, phase: int, timeout_s: float) -> None:
        self._phase = phase
        self.deadline_s = time.monotonic() + timeout_s
        self._guard.waiting.add(self)

    def _to_app(self) -> None:
        self._phase = APP
        self._guard.waiting.discard(self)
        self._not_evictable()

    def _begin_head(self) -> None:
        self._head_bytes = 0
        self._wait(HEAD, self._limits.header_timeout_s)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = self.capped and len(self.connections) >= self._limits.max_connections
        super().connection_made(transport)
        # No peer name: a socket its client already closed; such ones share one address.
        if self.capped and (refused := self._take_place(self.client[0] if self.client else "", full)):
            # Cheapest for both sides: nothing read, nothing held; clients retry a closed connection.
            self._guard.refused(refused)
            self._phase = APP
            transport.close()
            return
        self._begin_head()
        if self._address is not None:
            self._guard.evictable.add(self, self._address)

    def _take_place(self, address: str, full: bool) -> str | None:
        """Take a place for this connection from `address`, in a full table the place of an
        evictable connection (`ClientGuard.make_room`); the refusal's reason when there is none."""
        per_address = self._limits.max_connections_per_address
        open_now = self._guard.by_address.get(address, 0)
        if per_address and open_now >= per_address:
            return "address_limit"
        if full and not self._guard.make_room():
            return "connection_limit"
        if per_address:
            self._guard.by_address[address] = open_now + 1
        self._address = address
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._to_app()
        self._guard.stalled.discard(self)
        address = self._address
        if address is not None:
            self._address = None
            if self._limits.max_connections_per_address:
                by_address = self._guard.by_address
                left = by_address[address] - 1
                if left:
                    by_address[address] = left
                else:
                    del by_address[address]
        super().connection_lost(exc)

    def _not_evictable(self) -> None:
        if self._address is not None:
            self._guard.evictable.discard(self, self._address)

    def _linger(self) -> None:
        super()._linger()
        # Its last answer is written: a lingering connection waits only on its client, like an
        # idle one (else refused heads, one every 2 s a place, could keep a full table full).
        if self._lingering and self._address is not None and not self.transport.is_closing():
            self._guard.evictable.add(self, self._address)

    def evict(self) -> None:
        """Closed to give its place to a new connection (called by `ClientGuard.make_room`, which
        took it out of `evictable`): it had no request in the app. A close, as at the keep-alive
        deadline, unless answers are still buffered: its client is not reading them, and it is
        aborted (as at `send_timeout_s`)."""
        self._guard.refused("evicted")
        self._to_app()
        if self.transport.get_write_buffer_size():
            # Answers its client has not read: under a full table they would hold the place (and
            # a file descriptor) for up to `send_timeout_s` beside the connection that took it.
            self._guard.stalled.discard(self)
            self.transport.abort()
        else:
            self._close_when_sent()

    def pause_writing(self) -> None:
        super().pause_writing()
        if not self.transport.is_closing():
            self.send_deadline_s = time.monotonic() + self._limits.send_timeout_s
            self._guard.stalled.add(self)

    def resume_writing(self) -> None:
        if self.transport.is_closing():
            # Closed with the rest still buffered: bounded until it has gone, counted from now
            # (the client is reading).
            self.send_deadline_s = time.monotonic() + self._limits.send_timeout_s
        else:
            self._guard.stalled.discard(self)
        super().resume_writing()

    def _close_when_sent(self) -> None:
        """Close once what is buffered has been sent, and abort at `send_timeout_s` if the client
        reads none of it by then (`expire_send`): a close waits for the buffer, however long."""
        self._not_evictable()
        transport = self.transport
        transport.close()
        if transport.get_write_buffer_size() and self not in self._guard.stalled:
            self.send_deadline_s = time.monotonic() + self._limits.send_timeout_s
            self._guard.stalled.add(self)

    def data_received(self, data: bytes) -> None:
        if self._ending:  # the parser stopped: what the client still sends is dropped
            self._drop(len(data))
            return
        if self._phase == IDLE:  # the first bytes after idling begin a head (inlined: every request)
            self._phase = HEAD
            self._head_bytes = 0
            self.deadline_s = time.monotonic() + self._limits.header_timeout_s
        self._chunk = data
        self._message_ended_inside = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _HeadRefused):
                self._refuse(refused.status, refused.reason, refused.message)
                return
            if isinstance(refused, _PipelineFull):
                self._stop_reading()
                return
            self._bad_request()
            return
        except httptools.HttpParserUpgrade:
            # No upgrades are served: a plain request. Not uvicorn's own warning, two unstructured
            # log lines a request, which any client could send without a key and without bound.
            pass
        except httptools.HttpParserError:
            self._bad_request()
            return
        finally:
            self._chunk = b""  # an idle connection must not hold its last read
        if self._phase == HEAD:  # the head goes on in the next read
            self._head_tail = data[-3:]
            # The whole read is head (or blank lines before it) unless the head began after another
            # request in it; then its first part here goes uncounted, and it is measured from its
            # parsed parts when complete.
            if not self._message_ended_inside:
                self._head_bytes += len(data)
                if self._head_bytes > self._limits.max_header_bytes:
                    self._refuse(431, "header_too_large", self._too_large_message())

    def _bad_request(self) -> None:
        # In the error shape of every other answer (uvicorn's own is plain text, and its log line
        # is not JSON); counted with the other refusals.
        self._refuse(400, "invalid_http", "the request is not valid HTTP/1.1")

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            raise _PipelineFull
        super().on_message_begin()
        if self._phase != HEAD:
            self._begin_head()
        self._head_tail = b""
        self._head_start_unknown = self._message_ended_inside

    def on_headers_complete(self) -> None:
        # Counted here rather than per field (a call per header costs more than the check): the
        # byte limit already bounds how many fields can pile up before the head is complete.
        if len(self.headers) > self._limits.max_headers:
            raise _HeadRefused("too_many_headers", f"more than {self._limits.max_headers} header fields")
        limit = self._limits.max_header_bytes
        if (
            self._head_start_unknown or self._head_bytes + len(self._chunk) > limit
        ) and self._head_size() > limit:
            raise _HeadRefused("header_too_large", self._too_large_message())
        if (fault := self._framing.fault(self.headers, self.parser)) is not None:  # Host, Transfer-Encoding
            raise _HeadRefused(fault.reason, fault.message, fault.status)
        if self.parser.should_upgrade() and has_body(self.headers):
            raise _HeadRefused("upgrade_with_body", UPGRADE_WITH_BODY, 400)
        super().on_headers_complete()
        self._not_evictable()  # the request is the app's (or waits in the pipeline for it)
        self._phase = BODY
        self.deadline_s = time.monotonic() + self._limits.body_timeout_s
        cycle = self.cycle
        if not cycle.keep_alive:  # the client asked to close after this answer
            cycle.transport = CloseInstead(self.transport, self._closed_after_answer)
        elif cycle.waiting_for_100_continue:  # it may never send its body: `http_linger`
            close_if_body_withheld(cycle, self._closed_after_answer)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._message_ended_inside = True
        if self.cycle is not None and self.cycle.response_complete:
            self._wait(IDLE, self._limits.keepalive_timeout_s)  # answered before the body ended
        else:
            self._phase = APP
            self._guard.waiting.discard(self)

    def on_response_complete(self) -> None:
        # uvicorn's version, with the idle deadline in place of a keep-alive timer.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self._ending:
            if not self.pipeline:  # the last answer owed (when uvicorn kept no reference to it)
                self._linger()
                return
        else:
            self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        if self._phase == APP:
            self._phase = IDLE
            self.deadline_s = time.monotonic() + self._limits.keepalive_timeout_s
            self._guard.waiting.add(self)
        if self._address is not None:  # no request left in the app: it may give up its place
            self._guard.evictable.add(self, self._address)

    # -- limits

    def _stop_reading(self) -> None:
        """A request began past `MAX_PIPELINED` waiting ones: read nothing more. The requests taken
        are answered, the last with `connection: close`, and the connection lingers after it."""
        self._guard.refused("pipelined_requests")
        self._to_app()
        self._end_after_answers(self.pipeline[0][0] if self.pipeline else self.cycle)

    def _closed_after_answer(self) -> None:
        """uvicorn closes after an answer with `connection: close`: a lingering close if the request's
        body was not read whole (answered from its headers) or reading had stopped."""
        if self._phase == BODY or self._ending:
            self._to_app()
            self._linger()
        else:
            self._close_when_sent()

    def _head_size(self) -> int:
        """The bytes of the head that ends in the read being parsed (called when it is complete).
        Exact when the head's part in this read starts at its beginning; otherwise the larger of
        what was counted and a lower bound from the parsed parts."""
        chunk = self._chunk
        if self._head_start_unknown:
            size = self._parsed_head_size()
            if not self._head_tail:  # began in this read, after another request: nothing counted
                return size
        else:
            size = 0
        if not self._head_tail:  # began in this read, at its start or after blank lines
            start = _REQUEST_START.search(chunk)
            end = chunk.find(_HEAD_END, start.start() if start else 0) + len(_HEAD_END)
        else:  # the blank line may straddle the two reads
            probe = self._head_tail + chunk[:3]
            straddle = probe.find(_HEAD_END)
            if straddle >= 0:
                end = straddle + len(_HEAD_END) - len(self._head_tail)
            else:
                end = chunk.find(_HEAD_END) + len(_HEAD_END)
        return max(size, self._head_bytes + end)

    def _parsed_head_size(self) -> int:
        """The fewest bytes the parsed head can have been sent in: one space and `HTTP/1.x` on
        the request line, `name:value` fields, no optional whitespace."""
        fields = sum(len(name) + len(value) + 3 for name, value in self.headers)
        request_line = len(self.parser.get_method()) + len(self.url) + 12
        return request_line + fields + 2

    def _too_large_message(self) -> str:
        return f"request headers larger than {self._limits.max_header_bytes} bytes"

    def expire(self) -> None:
        """The deadline of the current phase passed (called by `ClientGuard.tick`)."""
        if self._phase == IDLE or (self._phase == HEAD and self._head_bytes == 0):
            # Answers still buffered (below the high-water mark, the writes never paused) keep
            # the close waiting on the client: bounded by `send_timeout_s` as any close is.
            self._to_app()
            self._close_when_sent()
        elif self._phase == HEAD:
            self._refuse(408, "header_timeout", "request headers not received in time")
        else:
            self._refuse(408, "body_timeout", "request body not received in time")

    def expire_send(self) -> None:
        """The client read nothing for `send_timeout_s` (called by `ClientGuard.tick`): abort, so
        that the buffer is dropped rather than flushed to a client that does not read. Losing the
        connection resumes the response's writes (they return at once) and tells the request its
        client left."""
        self._abort("send_timeout")

    def evict_stalled(self) -> None:
        """Aborted to give its place to a new connection (`ClientGuard.make_room`, with no
        connection evictable): its client reads nothing, so it is ended as at `send_timeout_s`."""
        self._abort("evicted")

    def _abort(self, reason: str) -> None:
        self._guard.refused(reason)
        self._guard.stalled.discard(self)
        self._to_app()
        self.transport.abort()

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer `status` with an OpenAI-shaped error when no response is under way, and end the
        connection with a lingering close (`_end_refused`). A request the app is still waiting on
        sees the client leave (its `receive` returns `http.disconnect`)."""
        self._guard.refused(reason)
        body_refused = self._phase == BODY
        self._to_app()
        self._end_refused(refusal_response(status, message, reason), body_refused)
