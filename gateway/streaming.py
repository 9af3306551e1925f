"""The streamed response: relay upstream SSE to the client, end cleanly on every failure.

Runs as a raw ASGI response in the request's own task. A client that leaves cancels that task
(`disconnect.py`: a watcher is started once the stream has run for a quarter second), which
closes the upstream connection, so the worker stops generating.

Every failed stream ends with exactly one error event in the gateway's OpenAI shape, then
`[DONE]`: the worker's own in-stream error rewritten by the relay (`sse.py`), or one the gateway
writes when the worker dies, closes without `[DONE]`, or the gateway drains. After a worker's
error event the upstream connection is closed at once, so the worker stops generating and the
client is never kept waiting on a worker that keeps talking.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import aiohttp
from starlette.types import Receive, Scope, Send

from gateway.disconnect import DisconnectGuard
from gateway.outcome import Attempt, record_request, usage_of
from gateway.sse import DONE_EVENT, SseRelay, error_event
from gateway.state import GatewayState
from gateway.upstream import UpstreamError
from policies.base import Outcome

log = logging.getLogger("kvgate.streaming")


class StreamSource(Protocol):
    """A worker's streamed answer: `read()` until it returns b"", then `release()` (the connection
    may be reused); `close()` drops it at any time, so the worker stops."""

    async def read(self) -> bytes: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class AiohttpSource:
    """An aiohttp response (https workers) as a `StreamSource`."""

    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    async def read(self) -> bytes:
        return await self._resp.content.readany()

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()


class ProxyStream:
    """An ASGI response that owns one upstream streamed response until it ends."""

    def __init__(self, state: GatewayState, attempt: Attempt, upstream: StreamSource, retries: int) -> None:
        self._state = state
        self._attempt = attempt
        self._upstream = upstream
        self._retries = retries
        self._abort_reason: str | None = None
        self._client_gone = False

    def abort(self, reason: str) -> None:
        """Stop relaying (drain deadline): the client gets a terminal error event."""
        self._abort_reason = reason
        self._upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._state.stream_started(self)
        # A client that leaves cancels this task (and so the relay, which closes the upstream).
        guard = DisconnectGuard(receive, self._state.disconnects)
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not guard.fired:
                raise
        finally:
            guard.close()
            self._state.stream_ended(self)

    async def _relay(self, send: Send) -> None:
        attempt = self._attempt
        a = attempt.admitted
        relay = SseRelay(a.strip_usage)
        failure: tuple[str, str] | None = None
        error: str | None = None
        status = 200
        answered = False  # the client has its whole stream (the worker's [DONE] was sent)
        upstream_broken = False  # the worker's connection failed after that: close, don't reuse
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                        (b"x-request-id", a.reply_id.encode()),
                    ],
                }
            )
            try:
                while chunk := await self._upstream.read():
                    if attempt.ttft_s is None:
                        attempt.first_token()
                    out = relay.feed(chunk)
                    if answered:
                        continue  # nothing follows [DONE]; read on so the connection can be reused
                    if relay.done and relay.error is None:
                        # The worker's [DONE] ends the client's response in the same write.
                        await send({"type": "http.response.body", "body": out, "more_body": False})
                        answered = True
                        continue
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                    if relay.error is not None:
                        break
            except (aiohttp.ClientError, UpstreamError, TimeoutError, ValueError) as exc:
                if answered:
                    upstream_broken = True
                else:
                    failure = (f"worker stream failed: {type(exc).__name__}", "upstream_stream_error")
            if self._abort_reason is not None and not answered:
                failure = (self._abort_reason, "gateway_shutting_down")
            elif failure is None and relay.error is not None:
                failure = ("worker reported an error mid-stream", relay.error.code)
                # Type, code and status only: the worker's message may quote the prompt.
                log.warning(
                    "worker reported an error mid-stream",
                    extra={
                        "request_id": a.request_id,
                        "worker": attempt.worker.url,
                        "error_type": relay.error.type,
                        "error_code": relay.error.code,
                        "worker_status": relay.error.worker_status,
                    },
                )
            elif failure is None and not relay.done:
                failure = ("worker stream ended before [DONE]", "upstream_stream_error")
            if not answered:
                tail = b""
                if failure is not None:
                    # One terminal error event (unless the relay already sent the worker's,
                    # rewritten), then [DONE]: the OpenAI SDKs raise on the error and stop cleanly.
                    if relay.error is None:
                        tail += error_event(failure[0], failure[1])
                    if not relay.done:
                        tail += DONE_EVENT
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        except asyncio.CancelledError:
            status = 499
            raise
        except OSError:
            # The client's socket went away while we were sending.
            self._client_gone = True
            status = 499
        except Exception as exc:
            # A gateway bug: still close the books (quota slot, worker load) and log it.
            log.error("stream relay failed", exc_info=exc, extra={"request_id": a.request_id})
            status = 500
        finally:
            if failure is None and relay.done and status == 200 and not upstream_broken:
                self._upstream.release()  # read to EOF: the connection goes back to the pool
            else:
                self._upstream.close()
            usage = usage_of(relay.usage)
            rejected = relay.error.worker_status if relay.error and relay.error.request_rejected else None
            if self._client_gone or status == 499:
                attempt.fail(self._state, Outcome.ABORTED)
                status = 499
                error = "client disconnected"
            elif status == 500:
                attempt.fail(self._state, Outcome.ABORTED)
                error = "internal_error"
            elif failure is not None and self._abort_reason is None and rejected is not None:
                # The worker blamed the request (a 4xx in its error event): like a 4xx answer, this
                # must not count against the worker's health, or one tenant could trip its breaker.
                attempt.fail(self._state, Outcome.REJECTED)
                status = rejected
                error = failure[1]
            elif failure is not None:
                attempt.fail(
                    self._state, Outcome.WORKER_FAILED if self._abort_reason is None else Outcome.ABORTED
                )
                status = 502 if self._abort_reason is None else 503
                error = failure[1]
            else:
                attempt.complete(self._state, usage)
                error = None
            record_request(
                self._state,
                a,
                status=status,
                worker=attempt.worker,
                reason=attempt.reason,
                usage=usage,
                ttft_s=attempt.ttft_s,
                retries=self._retries,
                error=error,
            )
