"""Dispatch: ask the policy for a worker, send, retry on the next-best worker before the first byte.

One attempt is one worker: `send_attempt` sends the request through the worker's transport (the lean
client for http:// workers, aiohttp for https) and returns the client's response, or the
`Failure` that ended the attempt. Transport exceptions become failures in one place
(`failure.failure_of`), which also says whether another worker may take the request: only while
nothing has reached the client (see `failure.py`). A 4xx from the worker is the client's problem
and is passed through, its error body rewritten into the gateway's own OpenAI error shape
(`whole_answer.answer`, which reads every answer that is not a stream).

Every attempt is closed by `Attempt.end`, and every request's books by `outcome.finish`: here
for whole answers and errors, in `streaming.ProxyStream` for a stream once it has started. A
whole answer's bytes stay reserved in the answer budget until they have been written to the
client (`answer_write.HeldResponse`); `whole_answer.answer` hands the reservation on or
releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar
from urllib.parse import urlsplit

from gateway.admitted import JSON_HEAD, Admitted
from gateway.errors import ApiError, RawResponse
from gateway.failure import (
    ERROR_PREFIX_BYTES,
    TRANSPORT_ERRORS,
    Failure,
    FirstEventTimeout,
    ReadTimeouts,
    RetryReason,
    Stage,
    failure_of,
    malformed,
    says_why,
    worker_failed,
    worker_said,
    worker_status,
)
from gateway.lifecycle import Lifecycle, shutting_down
from gateway.outcome import CLIENT_DISCONNECTED, Attempt, HeldVerdicts, finish
from gateway.pool_capacity import no_worker
from gateway.responses_affinity import holder_unavailable, pinned_decision
from gateway.responses_follow_up import locate_previous
from gateway.retries import advice, attempts_allowed
from gateway.routing import Routing
from gateway.sse import first_event_problem
from gateway.streaming import AiohttpSource, ProxyStream, StreamSource, first_events
from gateway.tracing import AttemptTrace, TracedSource
from gateway.transport import Transport
from gateway.upstream import Reservation, UpstreamReply, request_bytes
from gateway.upstream_headers import lean_lines, worker_headers
from gateway.whole_answer import answer, is_event_stream
from policies.base import Outcome, WorkerId

log = logging.getLogger("kvgate.proxy")

T = TypeVar("T")


async def dispatch(
    a: Admitted, routing: Routing, transport: Transport, lifecycle: Lifecycle
) -> RawResponse | ProxyStream:
    """Route and send one admitted request; always ends by recording it exactly once, even when
    the client leaves, or the policy or the gateway itself fails (the tenant's quota slot and the
    worker's load come back)."""
    attempts: list[Attempt] = []
    if lifecycle.past_deadline:  # arrived just before the listener closed
        err = shutting_down()
        _finish(routing, a, attempts, err.status, Outcome.ABORTED, err.code, err.message)
        return a.error_response(err)
    try:
        if a.find_previous is not None:
            missing = await locate_previous(a, transport)
            if missing is not None:
                # No worker holds it (404) or can continue it (400): the request is refused. A
                # 503 "could not tell" (or a 502: the gateway's credentials refused) refuses
                # nothing: the gateway gave up before any attempt.
                outcome = Outcome.REJECTED if missing.status < 500 else Outcome.ABORTED
                _finish(routing, a, attempts, missing.status, outcome, missing.code, missing.message)
                return a.error_response(missing)
        if a.pool.pd_router is not None:
            from gateway.pd import dispatch_pd  # a prefill/decode pool; gateway.pd builds on this module

            return await dispatch_pd(a, routing, transport, lifecycle, attempts)
        return await _dispatch(a, routing, transport, lifecycle, attempts)
    except asyncio.CancelledError:
        # The transport closed the worker's connection on the way out, so the worker stops.
        if lifecycle.ended_by_drain():  # the drain deadline, not the client: answer it
            err = shutting_down()
            _finish(routing, a, attempts, err.status, Outcome.ABORTED, err.code, err.message)
            return a.error_response(err)
        # The client left while the request waited on a worker (`disconnect.py` cancelled it).
        _finish(routing, a, attempts, 499, Outcome.ABORTED, CLIENT_DISCONNECTED)
        raise
    except Exception as exc:
        log.error("dispatch failed", exc_info=exc, extra={"request_id": a.request_id})
        err = ApiError(500, "internal gateway error", "server_error", "internal_error")
        _finish(routing, a, attempts, 500, Outcome.ABORTED, err.code, err.message)
        return a.error_response(err)


async def hold_for_peers(a: Admitted, routing: Routing) -> None:
    """Synced gateways in a burst: a long prefill waits for peers' same-instant choices (a
    Responses follow-up, bound to its worker, does not)."""
    if a.pinned is None:
        hold_s = routing.hold_s(a.route, time.monotonic())
        if hold_s > 0:
            a.held_s = hold_s
            await asyncio.sleep(hold_s)


async def _dispatch(
    a: Admitted, routing: Routing, transport: Transport, lifecycle: Lifecycle, attempts: list[Attempt]
) -> RawResponse | ProxyStream:
    await hold_for_peers(a, routing)
    verdicts = HeldVerdicts(attempts)  # the workers whose 5xx or read timeout awaits the request's fate
    try:
        return await _attempts(a, routing, transport, lifecycle, attempts, verdicts)
    except BaseException:
        verdicts.acquit()  # the client left (or the gateway failed): no evidence either way
        raise


async def _attempts(
    a: Admitted,
    routing: Routing,
    transport: Transport,
    lifecycle: Lifecycle,
    attempts: list[Attempt],
    verdicts: HeldVerdicts,
) -> RawResponse | ProxyStream:
    """Route and send the request, to another worker after each failure that allows it (up to
    the pool's `retry_attempts`, and after one read timeout at most): the client's response."""
    pool = a.pool
    tried: set[WorkerId] = set()
    failure: Failure | None = None  # why the latest attempt failed (None: no worker was tried)
    retry: RetryReason | None = None
    read_timeouts = ReadTimeouts()
    only_later = True  # every failed attempt asked to be retried later (a worker's 503)
    queue = routing.queues.get(pool.name)
    for n in range(attempts_allowed(pool.config.retry_attempts, a.retries_taken)):
        now_s = time.monotonic()
        policy = routing.policy  # the current one: a reload may swap it while an attempt runs
        if a.pinned is not None:  # a Responses follow-up: only the worker holding it can answer
            decision = pinned_decision(a.pinned, pool.views(now_s, frozenset(tried)))
        elif n == 0 and queue is not None:
            # Waits for a free worker slot while every worker is at its cap (queueing.py).
            routed = queue.try_route(a, policy) or await queue.wait(a, lambda: routing.policy)
            if isinstance(routed, Failure):
                failure = routed
                break
            decision, now_s = routed
            policy = routing.policy  # the one that chose: a reload may have swapped it meanwhile
        else:
            decision = policy.select(a.route, pool.views(now_s, frozenset(tried)), now_s)
        worker = pool.workers.get(decision.worker) if decision is not None else None
        if decision is None or worker is None or decision.worker in tried:
            break
        if retry is not None:
            routing.metrics.retries.labels(pool.name, retry).inc()
        if routing.decision_log is not None:
            views = pool.views(now_s, frozenset(tried))
            routing.decision_log.decided(a.request_id, a.route, decision, views, policy, now_s)
        tried.add(decision.worker)
        policy.on_dispatch(a.route, decision, now_s)
        routing.metrics.decision(routing.policy_name, decision.reason)
        trial = worker.acquire(a.route.n_prompt_tokens, a.max_output_tokens, now_s, decision.matched_tokens)
        attempt = Attempt(a, worker, decision.reason, now_s, decision, trial=trial)
        attempts.append(attempt)
        if routing.tracer is not None:
            attempt.trace = start_trace(routing, a, attempt)
        result = await send_attempt(routing, transport, lifecycle, a, attempt, n)
        if not isinstance(result, Failure):
            if served(result):
                verdicts.convict(time.monotonic())  # this one served it: the 5xx were the workers'
            else:
                verdicts.acquit()  # this worker refused or failed it too: the likely cause
            return result
        if attempt.trace is not None:
            attempt.trace.error_type = result.retry or result.code
        failure, retry = result, result.retry
        only_later = only_later and result.later
        if result.held and worker.breaker.holds(time.monotonic(), trial=attempt.trial):
            attempt.end(routing, result.outcome, judged=False)
            # A busy answer (503, 529) leaves no suspicion: its canary would be answered so too.
            verdicts.hold(worker, result.answered and not result.later)
        else:
            # The worker's breaker and load hear of it before the policy picks the next worker.
            attempt.end(routing, result.outcome)
        read_timeouts.note(result)
        if retry is None or read_timeouts.spent:
            break
    verdicts.acquit()  # no worker served it: no held failure is shown to be a worker's
    if a.pinned is not None:
        failure = holder_unavailable(failure)
    elif failure is None:
        failure = no_worker(pool, a.model, time.monotonic())
    response = a.error_response(failure.error())
    # Recorded with the status the client gets, which its route's envelope decides (a worker's 529
    # stays 529 on the Anthropic routes: `anthropic.error_response`).
    _finish(routing, a, attempts, response.status, failure.outcome, failure.code, failure.detail())
    if not failure.says_whether_to_retry(only_later):
        response.headers += advice(len(attempts), pool.config.retry_attempts, a.retries_taken)
    return response


def served(response: RawResponse | ProxyStream) -> bool:
    """Whether a worker's answer serves the request, which shows the held failures of the workers
    tried before it to be theirs (`HeldVerdicts.convict`): not a refusal (a 4xx), nor a stream
    whose first events end with the worker's own error (vLLM's 500 `GenerationError` there: the
    request failed on this worker too)."""
    if isinstance(response, ProxyStream):
        return not response.failed_at_once
    return response.status < 400


def _finish(
    routing: Routing,
    a: Admitted,
    attempts: list[Attempt],
    status: int,
    outcome: Outcome,
    error: str | None,
    detail: str | None = None,
) -> None:
    """Close the books on a request that ends without a worker's answer: `error` its code,
    `detail` its words (`outcome.record_request`)."""
    attempt = attempts[-1] if attempts else None
    retries = max(len(attempts) - 1, 0)
    finish(
        routing, a, attempt, status=status, outcome=outcome, retries=retries, error=error, error_detail=detail
    )


async def send_attempt(
    routing: Routing, transport: Transport, lifecycle: Lifecycle, a: Admitted, attempt: Attempt, retries: int
) -> RawResponse | ProxyStream | Failure:
    """Send the request to the attempt's worker: the client's response, or why this attempt failed
    (the attempt is then still open: the caller ends it and may try another worker)."""
    lean = transport.lean
    direct = attempt.worker.direct
    timeouts = a.pool.config.timeouts
    source: StreamSource | None = None
    held: Reservation | None = None
    stage = Stage.HEAD
    try:
        if direct is not None and lean is not None and not a.stream:
            # The hot path: a whole answer from an http:// worker, read by the lean client in one call.
            reply = await lean.post(
                direct.host,
                direct.port,
                _lean_request(a, attempt),
                connect_s=timeouts.connect_s,
                read_s=timeouts.read_s,
                total_s=timeouts.total_s,
                hold=transport.answers.share(a.tenant.name),
            )
            return answer(routing, a, attempt, reply, retries)
        deadline = first_event_deadline(a)
        source = await first_event_by(deadline, open_answer(transport, a, attempt))
        if attempt.trace is not None:
            attempt.trace.status = source.status
            if attempt.trace.recording:
                source = TracedSource(source, attempt.trace)
        if worker_failed(source.status, a.api.scale_out):
            return await worker_error(source, a)
        if a.stream and source.status == 200 and is_event_stream(source.content_type):
            # Nothing is sent to the client before the worker's first event, so a worker that
            # stalls or fails before it can still be replaced by another.
            stage = Stage.FIRST_EVENT
            relay = a.api.dialect.relay(a.strip_usage)
            first = await first_event_by(deadline, first_events(source, relay, attempt))
            problem = first_event_problem(first) if first else "it ended before its first event"
            if problem is not None:
                source.close()
                return malformed(f"worker sent a malformed stream ({problem})", stage)
            if a.responses is not None:
                a.learn_response(attempt.worker.worker_id, relay.response_id)
            if attempt.trace is not None:
                attempt.trace.note_first_events(first)
            return ProxyStream(routing, lifecycle, attempt, source, relay, first, retries)
        # A worker's 4xx, or a whole answer to a streamed request: read it and pass it through.
        stage = Stage.ANSWER
        held = Reservation(transport.answers.share(a.tenant.name))
        body = await source.read_held(held)
        source.release()
        reply = UpstreamReply(source.status, source.content_type, body, source.retry_hints, held)
        return answer(routing, a, attempt, reply, retries)
    except TRANSPORT_ERRORS as exc:
        if source is not None:
            source.close()
        if held is not None:
            held.release()
        return failure_of(exc, stage, timeouts)
    except BaseException:
        if source is not None:
            source.close()
        if held is not None:
            held.release()
        raise


def first_event_deadline(a: Admitted) -> float | None:
    """When a streamed request's attempt, sent now, must have its first event
    (`timeouts.first_event_s`, on the event loop's clock); None for a request not streamed."""
    if not a.stream:
        return None
    return asyncio.get_running_loop().time() + a.pool.config.timeouts.first_event_s


async def first_event_by(deadline: float | None, step: Awaitable[T]) -> T:
    """`step` (sending the request, or reading up to its first events), cut at `deadline` with
    `FirstEventTimeout` (a read timeout before the first byte: another worker may take the
    request). The transports' own timeouts (`read_s`) still apply within it."""
    if deadline is None:
        return await step
    bound = asyncio.timeout_at(deadline)
    try:
        async with bound:
            return await step
    except TimeoutError as exc:
        if bound.expired():
            raise FirstEventTimeout from exc
        raise


# The longest wait for a worker's error body after its head (`worker_error`): it is sent with
# the head (vLLM's is a small JSON), and a worker that stalls there must not hold the request.
ERROR_BODY_WAIT_S = 1.0


async def worker_error(source: StreamSource, a: Admitted) -> Failure:
    """The failure of a worker's answer whose head says it failed (`worker_failed`), `source`
    closed: with the worker's own message (`worker_said`) from the first `ERROR_PREFIX_BYTES` of
    its body when its status says why (`says_why`); the body is not waited for longer than
    `ERROR_BODY_WAIT_S` (nor `read_s`), and a body that does not come in time says nothing."""
    said = None
    try:
        if says_why(source.status):
            prefix = bytearray()
            wait_s = min(ERROR_BODY_WAIT_S, a.pool.config.timeouts.read_s)
            with contextlib.suppress(TimeoutError, *TRANSPORT_ERRORS):
                async with asyncio.timeout(wait_s):
                    while len(prefix) < ERROR_PREFIX_BYTES and (chunk := await source.read()):
                        prefix += chunk
            said = worker_said(prefix, a.withhold_salts)
    finally:
        source.close()
    return worker_status(source.status, source.retry_hints, said)


async def open_answer(transport: Transport, a: Admitted, attempt: Attempt) -> StreamSource:
    """Send the request; the answer's head, its body still to be read."""
    lean = transport.lean
    direct = attempt.worker.direct
    if direct is not None and lean is not None:
        timeouts = a.pool.config.timeouts
        return await lean.open_stream(
            direct.host,
            direct.port,
            _lean_request(a, attempt),
            connect_s=timeouts.connect_s,
            read_s=timeouts.read_s,
            total_s=timeouts.total_s,
            hold=transport.answers.share(a.tenant.name),
        )
    content_type = "application/json" if a.head is JSON_HEAD else _content_type(a.head)
    trace = attempt.trace.header_map.items() if attempt.trace is not None else ()
    headers = [("content-type", content_type)]
    headers += worker_headers(a.request_id, a.pool.auth, a.client_headers, trace)
    resp = await transport.upstream().post(
        attempt.worker.url + a.api.path,
        data=attempt.request_body(),
        headers=headers,
        timeout=a.pool.client_timeout,
    )
    return AiohttpSource(resp, transport.answers.share(a.tenant.name))


def _lean_request(a: Admitted, attempt: Attempt) -> bytes:
    direct = attempt.worker.direct
    assert direct is not None
    head = a.head + a.request_id.encode() + b"\r\n"
    head += a.pool.auth.lean_lines
    if a.client_headers:
        head += lean_lines(a.client_headers)
    if attempt.trace is not None:
        head += attempt.trace.headers  # traceparent (and tracestate): the attempt's CLIENT span
    return request_bytes(direct.host_header, a.api.path_bytes, head, attempt.request_body())


def _content_type(head: bytes) -> str:
    """The value of the `Content-Type` line that `Admitted.head` starts with."""
    return head.split(b"\r\n", 1)[0].partition(b":")[2].strip().decode("latin-1")


def start_trace(routing: Routing, a: Admitted, attempt: Attempt) -> AttemptTrace:
    assert routing.tracer is not None
    url = urlsplit(attempt.worker.url)
    decision = attempt.decision
    return routing.tracer.start_attempt(
        endpoint=a.endpoint,
        model=a.model,
        worker_url=attempt.worker.url,
        host=url.hostname,
        port=url.port or (443 if url.scheme == "https" else 80),
        policy=routing.policy_name,
        reason=decision.reason,
        predicted_cached_tokens=decision.matched_tokens,
    )
