"""One keep-alive HTTP/1.1 connection to a worker, parsed by httptools (the C parser uvicorn uses).

A connection serves one request at a time, in one of two modes: a whole answer (status, content
type and body, resolved when the answer is complete), or a stream (status and content type as
soon as the head arrives, then body chunks through a bounded buffer that pauses reading while the
consumer lags). Read and total timeouts are checked by the pool's `TimeoutSweep`. A whole
answer's bytes are reserved from the process's `AnswerBudget` as they arrive, in a `Reservation`
that goes with the complete answer (`UpstreamReply.held`: its new owner releases it once the
answer has been written to the client), or is released here when the exchange ends any other way
(`_reset`). The answer is gathered in one growing buffer, not a list of chunks joined at the
end: the join held a second copy of the answer next to its chunks, and the chunks' freed heap
memory is not given back to the system, so the process held about twice what it had reserved.
An answer's head (status line and headers) is bounded by `MAX_ANSWER_HEAD_BYTES`: httptools
itself puts no limit on a header's size.
"""

from __future__ import annotations

import asyncio
from dataclasses import field
from typing import cast

import httptools

from gateway.answer_budget import AnswerBudget, AnswerHold, Reservation, TenantShare
from gateway.stream_body import STREAM_RESUME_BYTES, StreamBody, StreamBuffers
from gateway.upstream_headers import ANSWER_HEADERS
from gateway.upstream_slots import TimeoutSweep
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


class AnswerTimeLimit(UpstreamTimeout):
    """The total timeout passed while the worker was still answering (not silent for the read
    timeout): how long an answer takes is mostly what the request asked for (`max_tokens`), so
    this is the gateway's limit on the request, not a verdict on the worker."""


class AnswerTooLarge(UpstreamError):
    """A whole answer passed `MAX_ANSWER_BYTES`: what the request asked for is more than the
    gateway relays in one answer, from any worker (the read ends and the connection is dropped).
    Not the worker's fault, and another worker would answer the same."""

    def __init__(self) -> None:
        super().__init__("worker answer too large", answered=True)


class AnswerBudgetExceeded(UpstreamError):
    """A whole answer's next `size` bytes would pass the process's `AnswerBudget`, or the
    tenant's share of it: the gateway's own limit, not the worker's fault (the read ends and the
    connection is dropped). Made right after the refusal, so `hold` still says which it was."""

    def __init__(self, hold: AnswerHold, size: int = 0) -> None:
        budget = hold.budget if isinstance(hold, TenantShare) else hold
        limit = f"limits.max_buffered_answer_bytes: {budget.capacity_bytes} bytes"
        if isinstance(hold, TenantShare) and hold.full_for(size):
            share = f"{hold.share_bytes} bytes of {limit}"
            message = f"the gateway holds this tenant's share of worker answers in memory ({share})"
        else:
            message = f"the gateway holds its limit of worker answers in memory ({limit})"
        super().__init__(message, answered=True)


def gather(body: AnswerBody, data: bytes) -> AnswerBody:
    """`body` followed by `data`. The first piece is kept as it came (most answers arrive in one:
    no copy), later ones go into one bytearray grown in place (a large one by remapping its
    pages, without copying them)."""
    if not body:
        return data
    if isinstance(body, bytearray):
        body += data
        return body
    return bytearray(body) + data


# The most bytes read before an answer's head is complete (the head, and the first bytes of the
# body that arrived with its end): past it the answer is malformed. vLLM's binary embeddings
# (`encoding_format` "bytes") put every input's offsets in one `metadata` header, which for a large
# batch outgrows the 8 KB header lines HTTP clients commonly allow; aiohttp's limits for https
# workers are the same (`transport.make_session`).
MAX_ANSWER_HEAD_BYTES = 1 << 20

# The answer headers the gateway keeps (`upstream_headers.ANSWER_HEADERS`), as (name, value)
# pairs: a worker's advice on when to retry (only an overloaded worker sends it), and vLLM's
# `metadata` of a binary embeddings answer; empty otherwise.
RetryHints = tuple[tuple[bytes, bytes], ...]

# A whole answer's body: the bytes as they came, or the bytearray they were gathered in (`gather`).
AnswerBody = bytes | bytearray


@record
class UpstreamReply:
    """A complete non-streamed answer. `held` is its bytes' reservation in the answer budget (None
    when it was released as the read ended): whoever takes the reply releases it, once the body
    has been written or dropped (`release`). The body may be the connection's `bytearray`, passed
    on as it is: making it `bytes` would copy the whole answer."""

    status: int
    content_type: str
    body: AnswerBody
    retry_hints: RetryHints = ()
    held: Reservation | None = field(default=None, compare=False)

    def release(self) -> None:
        if self.held is not None:
            self.held.release()


@record
class UpstreamHead:
    """The status and content type of a streamed answer, known before its body."""

    status: int
    content_type: str
    retry_hints: RetryHints = ()


class WorkerConnection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    __slots__ = (
        "_body",
        "_budget",
        "_clock",
        "_content_type",
        "_deadline_s",
        "_done",
        "_head",
        "_head_bytes",
        "_header_name",
        "_held",
        "_last_activity_s",
        "_loop",
        "_parser",
        "_paused",
        "_read_s",
        "_retry_hints",
        "_size",
        "_stream",
        "_streams",
        "_sweep",
        "alive",
        "got_bytes",
        "idle_since_s",
        "transport",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sweep: TimeoutSweep,
        budget: AnswerBudget,
        streams: StreamBuffers,
    ) -> None:
        self._loop = loop
        self._sweep = sweep
        self._clock = sweep.clock_for(loop)  # the deadlines' clock is the one the sweep checks them on
        self._budget = budget
        self._streams = streams
        # The whole answer being read: its bytes' reservation (from the request's tenant share,
        # or `_budget`) until the reply takes it, and its bytes so far.
        self._held: Reservation | None = None
        self._body: AnswerBody = b""
        self.transport: asyncio.Transport | None = None
        self.alive = False
        self.idle_since_s = 0.0
        self._done: asyncio.Future[UpstreamReply] | None = None
        # Stream mode: the head future, then the body the reader drains.
        self._head: asyncio.Future[UpstreamHead] | None = None
        self._stream: StreamBody | None = None
        self._paused = False
        self._parser: httptools.HttpResponseParser | None = None
        self._size = 0
        self._content_type = ""
        self._retry_hints: RetryHints = ()
        self._header_name = b""
        self._head_bytes: int | None = None  # bytes read of the answer's head (None: it is complete)
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
        self._last_activity_s = self._clock.time()
        if self._head_bytes is not None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_ANSWER_HEAD_BYTES:
                problem = f"worker sent a malformed answer (its head exceeds {MAX_ANSWER_HEAD_BYTES} bytes)"
                self._broken(UpstreamError(problem, answered=True))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken(UpstreamError("worker tried to upgrade the connection", answered=True))
        except httptools.HttpParserError:
            self._broken(UpstreamError("worker sent a malformed answer", answered=True))

    # httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self._content_type = value.decode("latin-1")
        elif lowered in ANSWER_HEADERS and all(seen != lowered for seen, _ in self._retry_hints):
            # The first value of each name, as aiohttp's `headers.get` gives for https workers:
            # a repeated `retry-after` must not crowd out `metadata`.
            self._retry_hints += ((lowered, value),)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        head = self._head
        if head is not None and self._parser is not None and not head.done():
            status = self._parser.get_status_code()
            head.set_result(UpstreamHead(status, self._content_type, self._retry_hints))

    def on_body(self, body: bytes) -> None:
        if self._stream is not None:
            self._stream.push(body)
            return
        held = self._held
        if held is None:  # the exchange ended earlier in this read (`_broken`): the rest is dropped
            return
        self._size += len(body)
        if self._size > MAX_ANSWER_BYTES:
            self._broken(AnswerTooLarge())
            return
        if not held.take(len(body)):
            self._broken(AnswerBudgetExceeded(held.hold, len(body)))
            return
        self._body = gather(self._body, body)

    def on_message_complete(self) -> None:
        parser = self._parser
        stream = self._stream
        if stream is not None and parser is not None:
            keep = parser.should_keep_alive()
            self._reset()
            if not keep:
                self.alive = False
                self._close()
            stream.end()
            return
        done = self._done
        if parser is None or done is None:
            return
        keep = parser.should_keep_alive()
        reply = UpstreamReply(
            parser.get_status_code(), self._content_type, self._body, self._retry_hints, self._held
        )
        self._held = None  # the reply owns the reservation now
        self._reset()
        if not keep:
            self.alive = False
            self._close()
        if done.done():
            reply.release()  # nobody waits for it
        else:
            done.set_result(reply)

    # requests --------------------------------------------------------------------------------
    def request(
        self, data: bytes, read_s: float, total_s: float, hold: AnswerHold | None = None
    ) -> asyncio.Future[UpstreamReply]:
        """Send a request whose answer is read whole, its bytes reserved from `hold` (the
        request's tenant share; the connection's budget alone when None). The reply holds the
        reservation: its taker releases it (`UpstreamReply.release`)."""
        self._held = Reservation(hold if hold is not None else self._budget)
        self._done = self._loop.create_future()
        self._head = None
        self._stream = None
        self._start(data, read_s, total_s)
        return self._done

    def _start(self, data: bytes, read_s: float, total_s: float) -> None:
        assert self.transport is not None
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        self._parser = httptools.HttpResponseParser(self)
        self._body = b""
        self._size = 0
        self._content_type = ""
        self._retry_hints = ()
        self._head_bytes = 0
        self.got_bytes = False
        now = self._clock.time()
        self._read_s = read_s
        self._deadline_s = now + total_s
        self._last_activity_s = now
        self._sweep.add(self)
        self.transport.write(data)

    def stream(self, data: bytes, read_s: float, total_s: float) -> asyncio.Future[UpstreamHead]:
        """Send a request whose answer is read as a stream: the head future resolves first, then
        `body` holds the chunks until the answer ends (or fails)."""
        self._head = self._loop.create_future()
        self._stream = StreamBody(self, self._streams)
        self._start(data, read_s, total_s)
        return self._head

    @property
    def body(self) -> StreamBody:
        assert self._stream is not None
        return self._stream

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        stream = self._stream
        if not self._paused or self.transport is None or stream is None or stream.size > STREAM_RESUME_BYTES:
            return
        self._paused = False
        self._last_activity_s = self._clock.time()  # the silence was ours, not the worker's
        self.transport.resume_reading()

    def check_timeout(self, now: float) -> None:
        """Fail the request if the worker has been silent for `read_s` (not counting time the
        reader made it wait), or `total_s` has passed."""
        silent_until = self._deadline_s if self._paused else self._last_activity_s + self._read_s
        if now < min(silent_until, self._deadline_s):
            return
        self.alive = False
        answered = self.got_bytes
        if answered and now < silent_until:
            self._fail(AnswerTimeLimit("answer outlasted the total timeout", answered=True))
        else:
            self._fail(UpstreamTimeout("worker timed out", answered=answered))
        self._close()

    def abort(self) -> None:
        """The caller gave up (client disconnect): drop the connection so the worker stops. A
        stream's unread bytes are given back (nobody reads them now)."""
        self.alive = False
        if self._stream is not None:
            self._stream.discard()
        self._reset()
        if self.transport is not None:
            self.transport.abort()

    def _broken(self, exc: UpstreamError) -> None:
        """The exchange failed mid-answer: the connection's remaining bytes belong to that
        answer, so it is never reused; closed here, whatever its caller then does."""
        self.alive = False
        self._fail(exc)
        self._close()

    def _fail(self, exc: UpstreamError) -> None:
        done, head, stream = self._done, self._head, self._stream
        self._reset()
        if done is not None and not done.done():
            done.set_exception(exc)
        if head is not None and not head.done():
            head.set_exception(exc)
        elif stream is not None and not stream.eof:
            stream.end(exc)

    def _reset(self) -> None:
        """The exchange is over (the stream's body stays readable until drained); a whole
        answer's reservation still here is released (its reply never came: the bytes are dropped)."""
        self._sweep.discard(self)
        self._parser = None
        self._done = None
        self._head = None
        self._body = b""
        if self._held is not None:
            self._held.release()
            self._held = None

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
