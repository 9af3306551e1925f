"""Dispatch: ask the policy for a worker, send, retry on the next-best worker before the first byte.

Retries happen only while nothing has reached the client: on a connect error, or a 5xx answer
(whose body is discarded). Timeouts are not retried (the worker may still be computing), and a
4xx from the worker is the client's problem and is passed through, its error body rewritten into
the gateway's own OpenAI error shape (the worker's message and `param` are kept).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson

from gateway.admission import UPSTREAM_PATHS, Admitted
from gateway.errors import ApiError, RawResponse, error_response, normalize_worker_error, upstream_error
from gateway.outcome import Attempt, Usage, record_request, usage_of
from gateway.registry import DirectAddress
from gateway.state import GatewayState
from gateway.streaming import AiohttpSource, ProxyStream
from gateway.upstream import (
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStream,
    UpstreamTimeout,
    request_bytes,
)
from policies.base import Outcome, WorkerId

log = logging.getLogger("kvgate.proxy")

UPSTREAM_PATHS_B = {endpoint: path.encode() for endpoint, path in UPSTREAM_PATHS.items()}


async def dispatch(a: Admitted, state: GatewayState) -> RawResponse | ProxyStream:
    """Route and send one admitted request; always ends by recording it exactly once, even when
    the policy or the gateway itself fails (the tenant's quota slot and the worker's load come back)."""
    attempts: list[Attempt] = []
    try:
        return await _dispatch(a, state, attempts)
    except Exception as exc:
        log.error("dispatch failed", exc_info=exc, extra={"request_id": a.request_id})
        attempt = attempts[-1] if attempts else None
        if attempt is not None:
            attempt.fail(state, Outcome.ABORTED)
        err = ApiError(500, "internal gateway error", "server_error", "internal_error")
        _finish_error(state, a, 500, attempt, len(attempts), err.message)
        return error_response(err, a.reply_id)


async def _dispatch(a: Admitted, state: GatewayState, attempts: list[Attempt]) -> RawResponse | ProxyStream:
    session = state.upstream()
    pool = a.pool
    timeouts = pool.config.timeouts
    timeout = pool.client_timeout
    headers = {"content-type": "application/json", "x-request-id": a.request_id}
    path = UPSTREAM_PATHS[a.endpoint]
    tried: set[WorkerId] = set()
    last: ApiError | None = None  # why the latest attempt failed (None: no worker was tried)
    attempt: Attempt | None = None
    for n in range(pool.config.retry_attempts + 1):
        now_s = time.monotonic()
        decision = state.policy.select(a.route, pool.views(now_s, frozenset(tried)), now_s)
        worker = pool.workers.get(decision.worker) if decision is not None else None
        if decision is None or worker is None or decision.worker in tried:
            break
        if n:
            state.metrics.retries.labels(pool.name).inc()
        tried.add(decision.worker)
        state.policy.on_dispatch(a.route, decision, now_s)
        state.metrics.decision(state.policy_name, decision.reason)
        worker.acquire(a.route.n_prompt_tokens, a.max_output_tokens, now_s)
        attempt = Attempt(a, worker, decision.reason, now_s, decision)
        attempts.append(attempt)
        if worker.direct is not None and state.lean is not None:
            # A plain-HTTP worker: the lean client (gateway/upstream.py).
            outcome = await _lean(state, a, attempt, worker.direct, n)
            if isinstance(outcome, ApiError):
                last = outcome
                if outcome.status == 504:
                    break
                continue
            return outcome
        try:
            resp = await session.post(
                worker.url + path, data=a.body_for(decision), headers=headers, timeout=timeout
            )
        except aiohttp.ConnectionTimeoutError:
            attempt.fail(state, Outcome.WORKER_FAILED)
            last = upstream_error(502, f"could not connect to a worker within {timeouts.connect_s:g} s")
            continue
        except TimeoutError:
            attempt.fail(state, Outcome.WORKER_FAILED)
            last = upstream_error(504, f"worker did not answer within {timeouts.read_s:g} s")
            break
        except (aiohttp.ClientError, OSError) as exc:
            attempt.fail(state, Outcome.WORKER_FAILED)
            last = upstream_error(502, f"could not reach a worker ({type(exc).__name__})")
            continue
        except asyncio.CancelledError:
            attempt.fail(state, Outcome.ABORTED)
            _finish_error(state, a, 499, attempt, n, "client disconnected")
            raise
        if resp.status >= 500:
            resp.close()
            attempt.fail(state, Outcome.WORKER_FAILED)
            last = upstream_error(502, f"worker answered {resp.status}")
            continue
        if a.stream and resp.status == 200 and resp.content_type == "text/event-stream":
            return ProxyStream(state, attempt, AiohttpSource(resp), retries=n)
        return await _whole(state, a, attempt, resp, n)
    if last is None:
        last = upstream_error(503, f"no healthy worker available for model '{a.model}'")
    _finish_error(state, a, last.status, attempt, len(tried), last.message)
    return error_response(last, a.reply_id)


async def _whole(
    state: GatewayState, a: Admitted, attempt: Attempt, resp: aiohttp.ClientResponse, retries: int
) -> RawResponse:
    """A non-streamed answer (or a worker's 4xx): pass it through (see `_answer`)."""
    try:
        body = await resp.read()
    except TimeoutError:
        resp.close()
        attempt.fail(state, Outcome.WORKER_FAILED)
        err = upstream_error(504, "worker timed out while sending its answer")
        _finish_error(state, a, 504, attempt, retries, err.message)
        return error_response(err, a.reply_id)
    except (aiohttp.ClientError, OSError) as exc:
        resp.close()
        attempt.fail(state, Outcome.WORKER_FAILED)
        err = upstream_error(502, f"worker connection failed mid-answer ({type(exc).__name__})")
        _finish_error(state, a, 502, attempt, retries, err.message)
        return error_response(err, a.reply_id)
    except asyncio.CancelledError:
        resp.close()
        attempt.fail(state, Outcome.ABORTED)
        _finish_error(state, a, 499, attempt, retries, "client disconnected")
        raise
    resp.release()
    content_type = resp.headers.get("content-type", "application/json")
    return _answer(state, a, attempt, resp.status, body, content_type, retries)


async def _lean(
    state: GatewayState, a: Admitted, attempt: Attempt, address: DirectAddress, retries: int
) -> RawResponse | ProxyStream | ApiError:
    """One attempt through the lean client: the response, or the error that ends this attempt
    (502 and 503 may be retried on another worker; 504 ends the request)."""
    lean = state.lean
    assert lean is not None
    timeouts = a.pool.config.timeouts
    head = b"Content-Type: application/json\r\nX-Request-Id: " + a.request_id.encode() + b"\r\n"
    request = request_bytes(
        address.host_header, UPSTREAM_PATHS_B[a.endpoint], head, a.body_for(attempt.decision)
    )
    try:
        if a.stream:
            stream = await lean.open_stream(
                address.host,
                address.port,
                request,
                connect_s=timeouts.connect_s,
                read_s=timeouts.read_s,
                total_s=timeouts.total_s,
            )
            return await _lean_stream(state, a, attempt, stream, retries)
        reply = await lean.post(
            address.host,
            address.port,
            request,
            connect_s=timeouts.connect_s,
            read_s=timeouts.read_s,
            total_s=timeouts.total_s,
        )
    except UpstreamBusy as exc:
        # The gateway's own connection cap, not a worker fault: the breaker is not told, and the
        # client gets 503 with Retry-After when no other worker takes the request.
        attempt.fail(state, Outcome.ABORTED)
        return upstream_error(503, f"worker at its connection limit ({exc})")
    except UpstreamConnectError as exc:
        attempt.fail(state, Outcome.WORKER_FAILED)
        if exc.timed_out:
            return upstream_error(502, f"could not connect to a worker within {timeouts.connect_s:g} s")
        return upstream_error(502, f"could not reach a worker ({exc})")
    except UpstreamTimeout as exc:
        attempt.fail(state, Outcome.WORKER_FAILED)
        if not exc.answered:
            return upstream_error(504, f"worker did not answer within {timeouts.read_s:g} s")
        err = upstream_error(504, "worker timed out while sending its answer")
        _finish_error(state, a, 504, attempt, retries, err.message)
        return error_response(err, a.reply_id)
    except UpstreamError as exc:
        attempt.fail(state, Outcome.WORKER_FAILED)
        if not exc.answered:
            return upstream_error(502, f"could not reach a worker ({exc})")
        err = upstream_error(502, f"worker connection failed mid-answer ({exc})")
        _finish_error(state, a, 502, attempt, retries, err.message)
        return error_response(err, a.reply_id)
    except asyncio.CancelledError:
        attempt.fail(state, Outcome.ABORTED)
        _finish_error(state, a, 499, attempt, retries, "client disconnected")
        raise
    if reply.status >= 500:
        attempt.fail(state, Outcome.WORKER_FAILED)
        return upstream_error(502, f"worker answered {reply.status}")
    return _answer(
        state, a, attempt, reply.status, reply.body, reply.content_type or "application/json", retries
    )


async def _lean_stream(
    state: GatewayState, a: Admitted, attempt: Attempt, stream: UpstreamStream, retries: int
) -> RawResponse | ProxyStream | ApiError:
    """A streamed request's answer head from the lean client: an event stream is relayed, a 5xx
    may be retried elsewhere, anything else (a worker's 4xx) is read whole and passed through.
    Errors while reading propagate to `_lean` after the connection is dropped."""
    if stream.status >= 500:
        stream.close()
        attempt.fail(state, Outcome.WORKER_FAILED)
        return upstream_error(502, f"worker answered {stream.status}")
    content_type = stream.content_type.split(";", 1)[0].strip().lower()
    if stream.status == 200 and content_type == "text/event-stream":
        return ProxyStream(state, attempt, stream, retries=retries)
    try:
        body = await stream.read_all()
    except BaseException:
        stream.close()
        raise
    stream.release()
    return _answer(state, a, attempt, stream.status, body, stream.content_type or "application/json", retries)


def _answer(
    state: GatewayState,
    a: Admitted,
    attempt: Attempt,
    status: int,
    body: bytes,
    content_type: str,
    retries: int,
) -> RawResponse:
    """Close the books on a complete answer and pass it through: a 200 byte for byte, an error
    with its body in the gateway's error shape."""
    usage = Usage()
    if status == 200:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        usage = usage_of(parsed.get("usage") if isinstance(parsed, dict) else None)
        attempt.complete(state, usage)
    else:
        # A 4xx is about the request, not the worker's health; the worker computed nothing.
        attempt.fail(state, Outcome.REJECTED if status < 500 else Outcome.WORKER_FAILED)
        if status >= 400:
            body = normalize_worker_error(status, body)
            content_type = "application/json"
    record_request(
        state,
        a,
        status=status,
        worker=attempt.worker,
        reason=attempt.reason,
        usage=usage,
        ttft_s=None,
        retries=retries,
    )
    headers = [(b"content-type", content_type.encode()), (b"x-request-id", a.reply_id.encode())]
    return RawResponse(status, body, headers)


def _finish_error(
    state: GatewayState, a: Admitted, status: int, attempt: Attempt | None, retries: int, error: str
) -> None:
    record_request(
        state,
        a,
        status=status,
        worker=attempt.worker if attempt else None,
        reason=attempt.reason if attempt else None,
        usage=Usage(),
        ttft_s=None,
        retries=retries,
        error=error,
    )
