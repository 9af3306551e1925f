"""The streamed response: relay upstream SSE to the client, end cleanly on every failure.

The proxy reads up to the worker's first event before a stream starts (`first_events`), so a
worker that fails before it can still be replaced. Then the response runs as a raw ASGI
response in the request's own task. A client that leaves cancels that task (`disconnect.py`: a
watcher is started once the stream has run for a quarter second), which closes the upstream
connection, so the worker stops generating.

Every failed stream ends with exactly one error event in the gateway's OpenAI shape, then
`[DONE]`: the worker's own in-stream error rewritten by the relay (`sse.py`; without the salt the
gateway sent, should the worker quote the request: `withheld_last_event`), or one the gateway writes when
the worker dies, closes without `[DONE]`, or the gateway drains. After a worker's
error event the upstream connection is closed at once, so the worker stops generating and the
client is never kept waiting on a worker that keeps talking. That error event counts against no
worker's breaker: the worker blamed the request (a 4xx: REJECTED), or itself for this one request
(a 5xx, or no status: vLLM's `GenerationError`, which a client's input can cause), and no other
worker's answer compares it (`outcome.HeldVerdicts`); it leaves the worker suspected, and the
gateway's own canary request decides (`gateway/canary.py`). A stream cut without `[DONE]` (the
connection lost, a malformed event) counts against its worker.

A stream whose `[DONE]` was sent is a success whatever happens next: the client has every token.
The disconnect watch stops before that last write (uvicorn reports a finished response to
`receive()` as a disconnect), and the worker's answer is then read to its end so its connection
is reused.

However a stream ends, it is charged at least the content events the relay forwarded
(`Relay.content_events`, `outcome.record_request`): one that ends before the worker's usage
would otherwise cost its tenant only its prompt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import aiohttp
from starlette.types import Receive, Scope, Send

from gateway.answer_usage import usage_of
from gateway.answer_write import send_in_pieces
from gateway.disconnect import DisconnectGuard
from gateway.failure import BUSY_STATUSES, TRANSPORT_ERRORS, Failure, Stage, failure_of, malformed
from gateway.lifecycle import Lifecycle
from gateway.outcome import CLIENT_DISCONNECTED, Attempt, finish
from gateway.routing import Routing
from gateway.sse import UNREADABLE_ERROR, Relay
from gateway.upstream import AnswerBody, AnswerHold, Reservation, RetryHints, read_reserved, read_whole
from gateway.upstream_headers import answer_hints
from policies.base import Outcome

log = logging.getLogger("kvgate.streaming")


class StreamSource(Protocol):
    """A worker's answer after its head: `read()` until it returns b"" (or `read_all()`; or
    `read_held(held)`, whose bytes stay reserved in the answer budget until `held` is released),
    then `release()` (the connection may be reused); `close()` drops it at any time, so the worker
    stops. Both transports' answers have this shape (`upstream.UpstreamStream`, `AiohttpSource`)."""

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str: ...

    @property
    def retry_hints(self) -> RetryHints: ...

    async def read(self) -> bytes: ...

    async def read_all(self) -> bytes: ...

    async def read_held(self, held: Reservation) -> AnswerBody: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class AiohttpSource:
    """An aiohttp response (https workers) as a `StreamSource`. `read` returns what aiohttp has
    buffered, which it keeps below a small high-water mark (it stops reading from the socket
    above it), so a stream's memory is bounded here as in the lean client; whole answers are
    bounded by `read_reserved` (each, and all together by `budget`: the request's tenant share of the
    process's budget), and single events by the relay."""

    __slots__ = ("_budget", "_resp", "content_type", "retry_hints", "status")

    def __init__(self, resp: aiohttp.ClientResponse, budget: AnswerHold) -> None:
        self._resp = resp
        self._budget = budget
        self.status = resp.status
        self.content_type = resp.headers.get("content-type", "")
        self.retry_hints: RetryHints = answer_hints(resp.headers)

    async def read(self) -> bytes:
        return await self._resp.content.readany()

    async def read_all(self) -> bytes:
        # Not `resp.read()`: that holds whatever the worker sends, however large.
        return await read_whole(self.read, self._budget)

    async def read_held(self, held: Reservation) -> AnswerBody:
        return await read_reserved(self.read, held)

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()


async def first_events(source: StreamSource, relay: Relay, attempt: Attempt) -> bytes:
    """Read until the relay has something for the client: the bytes the client's stream starts
    with (b"" if the worker's stream ended first). Transport errors propagate: nothing has reached
    the client yet."""
    while chunk := await source.read():
        attempt.first_token()
        out = relay.feed(chunk)
        if out:
            return out
    return b""


# A stream's events go to the client in pieces of at most this many bytes. uvicorn waits for its
# client connection's write buffer to drain below the high-water mark before taking the next
# piece, so a client that reads slowly holds at most one piece there beyond the mark, not all the
# events that arrived while it was not reading (up to the worker's pause threshold, 1 MiB).
STREAM_PIECE_BYTES = 64 * 1024


def withheld_last_event(out: bytes, withhold: Callable[[bytes], bytes]) -> bytes:
    """`out`, whose last event is the worker's error as the relay rewrote it (a relay forwards
    nothing after it), with `withhold` applied to that event (`Admitted.withhold_salts`: a
    worker's error may quote the request). Only that event is searched: its message and `param`
    are bounded (`sse.worker_error_of`)."""
    at = out.rfind(b"\n\n", 0, len(out) - 2)
    cut = at + 2 if at >= 0 else 0
    return out[:cut] + withhold(out[cut:])


class ProxyStream:
    """An ASGI response that owns one upstream streamed response until it ends, and closes the
    request's books when it does."""

    def __init__(
        self,
        routing: Routing,
        lifecycle: Lifecycle,
        attempt: Attempt,
        upstream: StreamSource,
        relay: Relay,
        first: bytes,
        retries: int,
    ) -> None:
        self._routing = routing
        self._lifecycle = lifecycle
        self._attempt = attempt
        self._upstream = upstream
        self._sse = relay
        self._first = first
        self._retries = retries
        self._abort_reason: str | None = None

    @property
    def failed_at_once(self) -> bool:
        """Whether the worker's first events already end with its error event: it did not serve
        the request, so it shows no other worker's failure of it to be that worker's."""
        return self._sse.error is not None

    def abort(self, reason: str) -> None:
        """Stop relaying (drain deadline): the client gets a terminal error event."""
        self._abort_reason = reason
        self._upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle = self._lifecycle
        lifecycle.stream_started(self)
        # A client that leaves cancels this task (and so the relay, which closes the upstream).
        guard = DisconnectGuard(receive, lifecycle.disconnects)
        try:
            await self._relay(send, guard)
        except asyncio.CancelledError:
            if not guard.fired:
                raise
        finally:
            guard.close()
            lifecycle.stream_ended(self)

    async def _relay(self, send: Send, guard: DisconnectGuard) -> None:
        relay = self._sse
        failure: Failure | None = None
        gone: int | None = None  # 499 or 500 when the client or the gateway ended the stream
        answered = False  # the client has its whole stream (the worker's [DONE] was sent)
        read_to_end = False  # after [DONE], the worker's answer ended cleanly: reuse the connection
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                        *self._attempt.admitted.reply_headers(),
                    ],
                }
            )
            out = self._first
            while True:
                if relay.done and relay.error is None:
                    # The worker's [DONE] ends the client's response in the same write. Nothing
                    # the client does after it can cost it a token: stop watching for its leaving.
                    guard.stop_watching()
                    await send({"type": "http.response.body", "body": out, "more_body": False})
                    answered = True
                    break
                if relay.error is not None:
                    if out:  # it ends with the worker's error event, which may quote the salt
                        out = withheld_last_event(out, self._attempt.admitted.withhold_salts)
                        await send_in_pieces(send, out, STREAM_PIECE_BYTES, more_body=True)
                    break
                if out:
                    await send_in_pieces(send, out, STREAM_PIECE_BYTES, more_body=True)
                try:
                    chunk = await self._upstream.read()
                    if not chunk:
                        break
                    out = relay.feed(chunk)
                except TRANSPORT_ERRORS as exc:
                    failure = failure_of(exc, Stage.STREAM, self._attempt.admitted.pool.config.timeouts)
                    break
            if answered:
                # Recorded now: the request's duration ends with its last byte, and its quota slot
                # is not held while the worker finishes its body.
                self._close_books(True, None, None)
                read_to_end = await self._read_to_end()
            else:
                failure = self._failure(failure)
                # One terminal error event in the route's shape (unless the relay already sent
                # the worker's, rewritten), then [DONE] where the API has one: the SDKs raise on
                # the error and stop cleanly.
                tail = relay.closing(failure.message, failure.code)
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        except asyncio.CancelledError:
            if not answered:
                gone = 499
            raise
        except OSError:
            # The client's socket went away while we were sending.
            gone = 499
        except Exception as exc:
            # A gateway bug: still close the books (quota slot, worker load) and log it.
            log.error(
                "stream relay failed", exc_info=exc, extra={"request_id": self._attempt.admitted.request_id}
            )
            gone = 500
        finally:
            if answered and read_to_end:
                self._upstream.release()  # the connection goes back to the pool
            else:
                self._upstream.close()
            if not answered:
                self._close_books(False, gone, failure)

    async def _read_to_end(self) -> bool:
        """After [DONE]: read the rest of the worker's answer (the end of its chunked body), so
        its connection can serve another request. False if that failed."""
        try:
            while await self._upstream.read():
                pass
        except TRANSPORT_ERRORS:
            return False
        return True

    def _failure(self, failure: Failure | None) -> Failure:
        """Why a stream that did not reach [DONE] ended (the client is told in its last event)."""
        relay = self._sse
        if self._abort_reason is not None:
            return Failure(503, self._abort_reason, "gateway_shutting_down", Outcome.ABORTED)
        if failure is not None:
            return failure
        if relay.error is not None:
            attempt = self._attempt
            # Type, code and status only: the worker's message may quote the prompt.
            log.warning(
                "worker reported an error mid-stream",
                extra={
                    "request_id": attempt.admitted.request_id,
                    "worker": attempt.worker.url,
                    "error_type": relay.error.type,
                    "error_code": relay.error.code,
                    "worker_status": relay.error.worker_status,
                },
            )
            message, code, status = (
                "worker reported an error mid-stream",
                relay.error.code,
                relay.error.worker_status,
            )
            if relay.error.request_rejected and status is not None:
                # The worker blamed the request (a 4xx in its error event): like a 4xx answer, this
                # must not count against the worker's health, or one tenant could trip its breaker.
                return Failure(status, message, code, Outcome.REJECTED)
            if relay.error is UNREADABLE_ERROR:  # not an error event at all: a malformed one
                return Failure(502, message, code, Outcome.WORKER_FAILED)
            # The worker blamed itself, for this request (vLLM's 500 `GenerationError`, which
            # a client's input can cause): it failed, and is up. Nothing compares it with another
            # worker's answer (the client has the stream), so it is held and acquitted at once,
            # like a lone 5xx answer (`outcome.HeldVerdicts`): counted, one tenant's streams would
            # open the pool's breakers one after another. A busy one (503, 529: SGLang's full
            # queue) leaves no suspicion, as a busy answer does: its canary would be refused alike.
            later = status in BUSY_STATUSES
            return Failure(502, message, code, Outcome.WORKER_FAILED, answered=True, later=later)
        return malformed("worker stream ended before its last event", Stage.STREAM)

    def _close_books(self, answered: bool, gone: int | None, failure: Failure | None) -> None:
        """Record how the stream ended (once: when its [DONE] is sent, else when it stops)."""
        attempt = self._attempt
        usage = usage_of(self._sse.usage)
        detail: str | None = None
        judged = True
        if answered:
            status, outcome, error = 200, Outcome.SERVED, None
        elif gone == 499:
            status, outcome, error = 499, Outcome.ABORTED, CLIENT_DISCONNECTED
        elif gone is not None or failure is None:
            status, outcome, error = 500, Outcome.ABORTED, "internal_error"
            detail = "internal gateway error"
        else:
            status, outcome, error = failure.status, failure.outcome, failure.code
            detail = failure.detail()
            judged = not failure.held  # the worker's own error event: no other worker compares it
            if not judged and not failure.later:
                attempt.worker.breaker.suspect()  # its canary decides (`gateway/canary.py`)
        finish(
            self._routing,
            attempt.admitted,
            attempt,
            status=status,
            outcome=outcome,
            usage=usage,
            retries=self._retries,
            error=error,
            error_detail=detail,
            delivered_tokens=self._sse.content_events,
            judged=judged,
        )
