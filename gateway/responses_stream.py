"""`GET /v1/responses/{id}?stream=true`: a stored response's events, relayed as the worker sends them.

vLLM answers a retrieve with `stream=true` (and `starting_after`) with the response's event
stream: the events stored so far at once, then each new one as a background response produces
it. The client gets each event when the worker sends it, through the Responses relay the
proxied `POST /v1/responses` streams use (`sse_named.ResponsesRelay`: whole events only, a
bounded partial event, the worker's error rewritten into the Responses error event, nothing after
the terminal event). As for proxied streams, a client that leaves cancels the relay and so closes
the worker's request (`disconnect.py`), a worker that dies or ends before the terminal event gets
one terminal error event written for it, and the drain deadline ends the stream with
`gateway_shutting_down` (`app.drain`).

The head goes out before the first event: only the worker holding the response can answer, so
there is no other worker to try, and a background response may take a while before its next
event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.config.pool import TimeoutsConfig
from gateway.disconnect import DisconnectGuard
from gateway.failure import TRANSPORT_ERRORS, Failure, Stage, failure_of, malformed
from gateway.lifecycle import Lifecycle
from gateway.outcome import CLIENT_DISCONNECTED
from gateway.sse_named import ResponsesRelay
from gateway.streaming import StreamSource, withheld_last_event
from policies.base import Outcome

_GATEWAY_SHUTTING_DOWN = "gateway_shutting_down"

log = logging.getLogger("kvgate.responses")


def stream_head(reply_id: str, rate_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The head of a relayed stored-response stream (a `HEAD` of one gets it too)."""
    return [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        (b"x-request-id", reply_id.encode()),
        *rate_headers,
    ]


class StoredResponseStream(Response):
    """An ASGI response that owns the worker's event stream until it ends, the worker's error
    event passed through `withhold` (the salts the tenant's requests carry); `done(status, error)`
    is called once when it does (200: the terminal event reached the client; 499: the client left;
    otherwise the status of what ended it), `error` the code of the client's error event (None on
    a success)."""

    def __init__(
        self,
        source: StreamSource,
        reply_id: str,
        lifecycle: Lifecycle,
        timeouts: TimeoutsConfig,
        done: Callable[[int, str | None], None],
        withhold: Callable[[bytes], bytes],
        rate_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        # Not Response.__init__: nothing here is a body known up front.
        self._withhold = withhold  # the tenant's salts out of the worker's error event
        self._source = source
        self._reply_id = reply_id
        self._rate_headers = rate_headers or []  # the tenant's `x-ratelimit-*`
        self._lifecycle = lifecycle
        self._timeouts = timeouts
        self._done = done
        self._relay = ResponsesRelay()
        self._abort_reason: str | None = None
        self._started = False  # the answer's head has been sent

    def abort(self, reason: str) -> None:
        """Stop relaying (drain deadline): the client gets a terminal error event."""
        self._abort_reason = reason
        self._source.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle = self._lifecycle
        lifecycle.stream_started(self)
        guard = DisconnectGuard(receive, lifecycle.disconnects)
        code: str | None
        status, code = 499, CLIENT_DISCONNECTED
        try:
            status, code = await self._run(send, guard)
        except asyncio.CancelledError:
            if not guard.fired:
                raise
        except OSError:
            pass  # the client's socket went away while we were sending
        except Exception as exc:
            # A gateway bug: still end the stream, close the books (the tenant's slot, the count)
            # and log it.
            log.error("stored response relay failed", exc_info=exc, extra={"request_id": self._reply_id})
            status, code = 500, "internal_error"
            if self._started:
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            guard.close()
            lifecycle.stream_ended(self)
            self._source.close()  # a no-op once the worker's answer has ended
            self._done(status, code)

    async def _run(self, send: Send, guard: DisconnectGuard) -> tuple[int, str | None]:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": stream_head(self._reply_id, self._rate_headers),
            }
        )
        self._started = True
        relay = self._relay
        failure: Failure | None = None
        while not relay.done and relay.error is None:
            try:
                chunk = await self._source.read()
                if not chunk:
                    break
                out = relay.feed(chunk)
                if relay.error is not None and out:
                    out = withheld_last_event(out, self._withhold)
            except TRANSPORT_ERRORS as exc:
                failure = failure_of(exc, Stage.STREAM, self._timeouts)
                break
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        if relay.done and relay.error is None:
            # The client has the whole stream: its leaving now costs it nothing.
            guard.stop_watching()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return 200, None
        if self._abort_reason is not None:
            failure = Failure(503, self._abort_reason, _GATEWAY_SHUTTING_DOWN, Outcome.ABORTED)
        elif failure is None and relay.error is None:
            failure = malformed("worker stream ended before its last event", Stage.STREAM)
        message, code = (failure.message, failure.code) if failure is not None else ("", "")
        # One terminal error event (unless the relay already sent the worker's, rewritten).
        await send({"type": "http.response.body", "body": relay.closing(message, code), "more_body": False})
        if failure is not None:
            return failure.status, failure.code
        error = relay.error
        worker_status = error.worker_status if error is not None else None
        status = worker_status if worker_status is not None and 400 <= worker_status < 600 else 502
        return status, error.code if error is not None else None
