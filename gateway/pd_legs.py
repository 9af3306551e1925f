"""The two legs of a split request: sending each to its worker (their bodies: `pd_bodies`), and
the answer.

A leg's answer is held back until the caller knows what to do with it: the prefill answer gives
the decode leg its `kv_transfer_params` (vLLM) and the client its `cached_tokens`; the decode
answer (`Opened`) reaches the client only once no failure can still send the request elsewhere
(with SGLang, once it opens: a prefill leg still running then is closed on its own).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, ClassVar

import orjson

from gateway import proxy, whole_answer
from gateway.admitted import Admitted
from gateway.answer_usage import Usage, usage_of
from gateway.errors import RawResponse
from gateway.failure import (
    TRANSPORT_ERRORS,
    Failure,
    Stage,
    failure_of,
    malformed,
    worker_failed,
    worker_status,
)
from gateway.lifecycle import Lifecycle
from gateway.outcome import Attempt
from gateway.routing import Routing
from gateway.sse import SseRelay, data_of, first_event_problem
from gateway.sse_named import MessagesRelay, NamedEventRelay, ResponsesRelay
from gateway.streaming import ProxyStream, StreamSource, first_events
from gateway.transport import Transport
from gateway.upstream_conn import UpstreamReply
from policies.base import Outcome


def with_cached_tokens(payload: bytes, cached_tokens: int, dialect: str = "openai") -> bytes:
    """A whole answer (or a chat stream's usage chunk) with its usage's cached prompt tokens
    replaced, in the field its route's clients read (`set_cached_tokens`); the payload unchanged
    when it has no usage."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict) or not set_cached_tokens(usage, cached_tokens, dialect):
        return payload
    return orjson.dumps(obj)


def set_cached_tokens(usage: dict[str, Any], cached_tokens: int, dialect: str) -> bool:
    """Put `cached_tokens` in `usage` where its dialect's clients read it, the prompt's total
    kept: OpenAI's `prompt_tokens_details.cached_tokens`, Responses'
    `input_tokens_details.cached_tokens`, and Anthropic's `cache_read_input_tokens`, whose
    `input_tokens` is the uncached rest (vLLM's Messages route reports the whole prompt there and
    no cache fields: the same total). False when `usage` has no prompt figures to correct."""
    if dialect == "anthropic":
        if not isinstance(usage.get("input_tokens"), int):
            return False  # a `message_delta` that carries only the output so far
        created = _count(usage.get("cache_creation_input_tokens"))
        total = usage["input_tokens"] + _count(usage.get("cache_read_input_tokens")) + created
        read = max(0, min(cached_tokens, total - created))
        usage["cache_read_input_tokens"] = read
        usage["input_tokens"] = total - created - read
        return True
    name = "input_tokens_details" if dialect == "responses" else "prompt_tokens_details"
    details = usage.get(name)
    usage[name] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached_tokens}
    return True


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class PdRelay(SseRelay):
    """The decode worker's stream, its usage reporting the prefill worker's `cached_tokens` once
    that is known: the decode worker counts the KV it received as cached, while the client is
    owed the prefix-cache hit (vllm-router rewrites it the same way)."""

    __slots__ = ("cached_tokens",)

    def __init__(self, strip_usage: bool) -> None:
        super().__init__(strip_usage)
        self.cached_tokens: int | None = None

    def _rewrite(self, payload: bytes) -> bytes | None:
        if self.cached_tokens is not None and b'"usage"' in payload:
            payload = with_cached_tokens(payload, self.cached_tokens)
        return super()._rewrite(payload)


class _PrefillHitRelay(NamedEventRelay):
    """`PdRelay` for a named-event stream (Responses, Anthropic Messages): every event that
    carries usage reports the prefill worker's hit, in the field of the route's `DIALECT`."""

    __slots__ = ()
    DIALECT: ClassVar[str]
    cached_tokens: int | None

    def _inspect(self, event: bytes) -> bytes | None:
        if self.cached_tokens is not None and b'"usage"' in event:
            event = _event_with_cached_tokens(event, self.cached_tokens, self.DIALECT)
        return super()._inspect(event)


class PdResponsesRelay(_PrefillHitRelay, ResponsesRelay):
    """Its usage rides in `response.completed`'s response."""

    __slots__ = ("cached_tokens",)
    DIALECT = "responses"

    def __init__(self) -> None:
        super().__init__()
        self.cached_tokens = None


class PdMessagesRelay(_PrefillHitRelay, MessagesRelay):
    """Usage in `message_start`'s message and in `message_delta`."""

    __slots__ = ("cached_tokens",)
    DIALECT = "anthropic"

    def __init__(self) -> None:
        super().__init__()
        self.cached_tokens = None


DecodeRelay = PdRelay | PdResponsesRelay | PdMessagesRelay


def decode_relay(a: Admitted) -> DecodeRelay:
    """The relay of a decode leg's stream, in the route's own event format (as
    `Dialect.relay`), with the prefill worker's hit put in its usage."""
    dialect = a.api.dialect.name
    if dialect == "responses":
        return PdResponsesRelay()
    if dialect == "anthropic":
        return PdMessagesRelay()
    return PdRelay(a.strip_usage)


def _event_with_cached_tokens(event: bytes, cached_tokens: int, dialect: str) -> bytes:
    """An event (its `event:` and `data:` lines) whose usage, at the top or in its `response` or
    `message` object, reports `cached_tokens`; unchanged when it has none."""
    if b'"usage"' not in event:
        return event
    payload = data_of(event)
    try:
        obj = orjson.loads(payload) if payload is not None else None
    except orjson.JSONDecodeError:
        return event
    if not isinstance(obj, dict):
        return event
    holder = obj.get("response") or obj.get("message")
    usage = obj.get("usage") or (holder.get("usage") if isinstance(holder, dict) else None)
    if not isinstance(usage, dict) or not set_cached_tokens(usage, cached_tokens, dialect):
        return event
    lines = [line for line in event.split(b"\n") if not line.startswith(b"data:")]
    return b"\n".join([*lines, b"data: " + orjson.dumps(obj)])


@dataclasses.dataclass(slots=True)
class Prefilled:
    """A prefill leg that answered 200: what it returned for the decode leg, and its usage."""

    params: dict[str, Any] | None
    usage: Usage


@dataclasses.dataclass(slots=True)
class Opened:
    """A decode leg's answer before the client has any of it: a stream up to its first events
    (`relay` set), or a whole answer in `body`. `deliver` hands it to the client."""

    source: StreamSource
    status: int
    content_type: str
    relay: DecodeRelay | None = None
    first: bytes = b""
    body: bytes = b""


@dataclasses.dataclass(slots=True)
class Refused:
    """A leg the worker refused with a 4xx: the request's fault, answered as it is."""

    reply: UpstreamReply


@dataclasses.dataclass(slots=True)
class TransferFailed:
    """The decode worker answered but could not get the prompt's KV (a 5xx, or an error event
    before the first token): `reason` labels the failures counter; `status` that the answer's
    own status was the 5xx."""

    failure: Failure
    reason: str
    status: bool = False


async def prefill_leg(
    routing: Routing, transport: Transport, a: Admitted, attempt: Attempt
) -> Prefilled | Refused | Failure:
    """Send the prefill leg and read its whole answer. The attempt is closed here on success (its
    worker now holds the prompt); on failure the caller closes it."""
    timeouts = a.pool.config.timeouts
    source: StreamSource | None = None
    stage = Stage.HEAD
    try:
        # For a streamed request the leg's head is its first event's first part: vLLM answers it
        # once the prompt is prefilled, so it is bounded as a first event is (`first_event_s`).
        deadline = proxy.first_event_deadline(a)
        source = await proxy.first_event_by(deadline, proxy.open_answer(transport, a, attempt))
        if attempt.trace is not None:
            attempt.trace.status = source.status
        if worker_failed(source.status):
            return await proxy.worker_error(source, a)
        stage = Stage.ANSWER
        body = await source.read_all()
        source.release()
    except TRANSPORT_ERRORS as exc:
        if source is not None:
            source.close()
        return failure_of(exc, stage, timeouts)
    except BaseException:
        if source is not None:
            source.close()
        raise
    if source.status != 200:
        return Refused(UpstreamReply(source.status, source.content_type, body, source.retry_hints))
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        return malformed(
            "prefill worker sent a malformed answer (its body is not a JSON object)", Stage.ANSWER
        )
    params = parsed.get("kv_transfer_params")
    usage = usage_of(parsed.get("usage"))
    attempt.first_token()  # one output token: the leg's time is the prompt's time to first token
    attempt.end(routing, Outcome.SERVED, usage)
    return Prefilled(params if isinstance(params, dict) else None, usage)


async def decode_leg(
    transport: Transport, a: Admitted, attempt: Attempt
) -> Opened | Refused | TransferFailed | Failure:
    """Send the decode leg and read up to its first events (or its whole answer). Nothing reaches
    the client here; on failure the caller closes the attempt."""
    timeouts = a.pool.config.timeouts
    source: StreamSource | None = None
    stage = Stage.HEAD
    try:
        deadline = proxy.first_event_deadline(a)
        source = await proxy.first_event_by(deadline, proxy.open_answer(transport, a, attempt))
        if attempt.trace is not None:
            attempt.trace.status = source.status
        if worker_failed(source.status):
            failure = await proxy.worker_error(source, a)
            if failure.later:
                return failure  # overloaded (503, 529): it took no part in a transfer, its own failure
            return TransferFailed(failure, "decode_error", True)
        if a.stream and source.status == 200 and whole_answer.is_event_stream(source.content_type):
            stage = Stage.FIRST_EVENT
            relay = decode_relay(a)
            first = await proxy.first_event_by(deadline, first_events(source, relay, attempt))
            problem = first_event_problem(first) if first else "it ended before its first event"
            if problem is not None:
                source.close()
                return malformed(f"decode worker sent a malformed stream ({problem})", stage)
            if relay.error is not None and not relay.error.request_rejected:
                # vLLM streams a failed KV load as a 200 whose first event is the error.
                source.close()
                return TransferFailed(worker_status(relay.error.worker_status or 500), "decode_error")
            return Opened(source, source.status, source.content_type, relay, first)
        stage = Stage.ANSWER
        body = await source.read_all()
        source.release()
    except TRANSPORT_ERRORS as exc:
        if source is not None:
            source.close()
        failure = failure_of(exc, stage, timeouts)
        if failure.status == 504 and failure.retry is not None and a.stream:
            return TransferFailed(failure, "timeout")  # no first event yet: the KV never came
        # A whole answer comes only once it is complete (vLLM sends nothing before): its read
        # timeout says nothing of the transfer, and is the decode worker's, as any worker's.
        return failure
    except BaseException:
        if source is not None:
            source.close()
        raise
    if 400 <= source.status < 500:
        return Refused(UpstreamReply(source.status, source.content_type, body, source.retry_hints))
    return Opened(source, source.status, source.content_type, body=body)  # a 200 (or 1xx-3xx) whole


async def both_legs(
    p_task: asyncio.Task[Prefilled | Refused | Failure],
    d_task: asyncio.Task[Opened | Refused | TransferFailed | Failure],
    grace_s: float = 0.0,
) -> tuple[Prefilled | Refused | Failure | None, Opened | Refused | TransferFailed | Failure | None]:
    """Wait for the decode leg's answer; once either leg fails, stop the other (None: stopped
    before it ended). A decode answer that opens before the prefill leg has ended leaves that leg
    running (None, its task not done): the caller relays the answer and closes the prefill leg
    on its own. A decode worker's 5xx answer leaves the prefill leg `grace_s` to end first: a
    prefill worker that is down fails its leg within the connect timeout, and its failure, not the
    decode worker's, is then why the KV did not come."""
    pending: set[asyncio.Task[Any]] = {p_task, d_task}
    failed = False
    while d_task in pending and not failed:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        failed = any(not isinstance(task.result(), Prefilled | Opened) for task in done)
    if failed and p_task in pending and grace_s > 0:
        answer = d_task.result() if d_task.done() else None
        if isinstance(answer, TransferFailed) and answer.status:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
    if failed:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    p = p_task.result() if p_task.done() and not p_task.cancelled() else None
    d = None if d_task.cancelled() else d_task.result()
    return p, d


def deliver(
    routing: Routing,
    lifecycle: Lifecycle,
    a: Admitted,
    attempt: Attempt,
    opened: Opened,
    cached: int | None,
    retries: int,
) -> RawResponse | ProxyStream | Failure:
    """The decode answer to the client, reporting the prefill worker's `cached_tokens`."""
    relay = opened.relay
    if relay is not None:
        first = opened.first
        if cached is not None:
            # The first events were read before the relay knew the hit (under SGLang the prefill
            # may answer after them; a short answer may come whole): they and the usage noted so
            # far report it too.
            relay.cached_tokens = cached
            dialect = a.api.dialect.name
            first = b"\n\n".join(_event_with_cached_tokens(e, cached, dialect) for e in first.split(b"\n\n"))
            if isinstance(relay.usage, dict):
                set_cached_tokens(relay.usage, cached, dialect)
        a.learn_response(attempt.worker.worker_id, relay.response_id)
        return ProxyStream(routing, lifecycle, attempt, opened.source, relay, first, retries)
    body = opened.body
    if opened.status == 200 and cached is not None:
        body = with_cached_tokens(body, cached, a.api.dialect.name)
    reply = UpstreamReply(opened.status, opened.content_type, body, opened.source.retry_hints)
    return whole_answer.answer(routing, a, attempt, reply, retries)
