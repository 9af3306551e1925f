"""OpenTelemetry traces of the completion path (off unless `tracing.enabled`).

Two kinds of span, named `{operation} {model}` as the GenAI conventions ask (`chat` for
/v1/chat/completions, `text_completion` for /v1/completions):

- SERVER: one per completion request, from its arrival to its last byte. When the client sent a
  W3C `traceparent` (and `tracestate`), the span is its child, so the gateway joins the client's
  trace. Rejected requests (bad key, quota, overload) get one too, with their request id and
  tenant (`outcome.record_refusal`), so they join their access lines.
- CLIENT: one per attempt on a worker (a request retried on another worker has several), child
  of the SERVER span. Its context travels to the worker as the `traceparent` / `tracestate`
  headers of the upstream request, so the engine's own spans (vLLM `--otlp-traces-endpoint`)
  join the same trace under the attempt that caused them.

Attributes follow the GenAI semantic conventions. Both spans: `gen_ai.operation.name`,
`gen_ai.provider.name`, `gen_ai.request.model`, `error.type` on failure. The SERVER span adds the
HTTP status, `kvgate.tenant`, `kvgate.request_id` and `kvgate.retries`. Each CLIENT span adds what
the worker answered, `gen_ai.response.id` / `.model` / `.finish_reasons` and `gen_ai.usage.*`
(`cache_read.input_tokens`: the cached tokens the worker reported), the worker's
`server.address` / `server.port`, and kvgate's routing: `kvgate.route.policy`, `.reason`, `.worker`
and `.predicted_cached_tokens` (the decision's matched prefix), `kvgate.attempt.outcome`. What the
worker answered is not copied onto the SERVER span: with the Python SDK, each attribute costs
about a microsecond or two of validation. Prompt and answer content are never attached; the answer
is read only for its id, model and finish reasons.

With tracing off, nothing in this module runs: the request path checks `routing.tracer` and
`Attempt.trace` and does nothing more. The SDK and its exporter are set up in `otel_sdk.py`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Message, Receive, Scope, Send

from gateway.config import TracingConfig
from gateway.otel_sdk import kvgate_version, tracer_provider
from gateway.upstream import AnswerBody, Reservation, RetryHints
from policies.base import Outcome

# GenAI operation names; a route without one is named by its endpoint label (`rerank`, ...).
_OPERATION = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
    "embeddings": "embeddings",
}
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# The same names as a pool's `forward_headers` spells them: withheld from workers while tracing.
TRACE_CONTEXT_HEADERS = frozenset(h.decode() for h in _TRACE_HEADERS)
# W3C Trace Context's `tracestate`: comma-separated list members `key=value` (empty members and
# spaces or tabs around each allowed), keys unique. A client's header outside this grammar or
# these bounds is dropped before the propagator sees it: the OpenTelemetry API's parser logs an
# invalid member's whole text, once per request, and a warning for a header longer than 8,192
# characters (its own bound; W3C asks every vendor to pass on at least 512).
MAX_TRACESTATE_CHARS = 8192
MAX_TRACESTATE_MEMBERS = 32
_TRACESTATE_KEY_CHARS = r"[a-z0-9_\-*/]"
_TRACESTATE_KEY = (
    rf"[a-z]{_TRACESTATE_KEY_CHARS}{{0,255}}"  # simple-key
    rf"|[a-z0-9]{_TRACESTATE_KEY_CHARS}{{0,240}}@[a-z]{_TRACESTATE_KEY_CHARS}{{0,13}}"  # tenant@system
)
_TRACESTATE_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_TRACESTATE_MEMBER = re.compile(rf"({_TRACESTATE_KEY})={_TRACESTATE_VALUE}")
# A finish reason in a streamed chunk (`"finish_reason":null` until the last chunk of a choice).
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')
_MAX_FINISH_REASONS = 16  # one per choice; `n` is bounded by the worker, this by us
_SCAN_OVERLAP = 96  # bytes kept from the previous chunk, so a reason cut in two is still found

ProxyHandler = Callable[[Scope, Receive, Send, Any], Awaitable[None]]


@dataclass(slots=True)
class AttemptTrace:
    """The CLIENT span of one attempt, its context as request headers, and what the worker's
    answer said about itself (filled in as the answer arrives; written when the attempt ends)."""

    span: Span
    headers: bytes  # `traceparent: ...\r\n` (and `tracestate`) for the lean client's request head
    header_map: dict[str, str]  # the same, for aiohttp
    recording: bool = True  # False: the sampler dropped the span; only its context travels
    status: int | None = None
    response_id: str | None = None
    response_model: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error_type: str | None = None
    _tail: bytes = b""

    def note_answer(self, parsed: dict[str, Any]) -> None:
        """A whole answer (a JSON object): its id, model and finish reasons."""
        if not self.recording:
            return
        self._note_ids(parsed)
        choices = parsed.get("choices")
        if isinstance(choices, list):
            for choice in choices[:_MAX_FINISH_REASONS]:
                reason = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(reason, str):
                    self.finish_reasons.append(reason)

    def note_first_events(self, first: bytes) -> None:
        """A stream's first events (whole events, as the relay forwards them): id and model."""
        if not self.recording:
            return
        for line in first.split(b"\n"):
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                try:
                    parsed = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    return
                if isinstance(parsed, dict):
                    self._note_ids(parsed)
                return

    def scan(self, chunk: bytes) -> None:
        """A streamed chunk as it arrived: collect the finish reasons it carries."""
        data = self._tail + chunk
        skip = len(self._tail)  # a match wholly inside the tail was counted with the last chunk
        for match in _FINISH_REASON.finditer(data):
            if match.end() > skip and len(self.finish_reasons) < _MAX_FINISH_REASONS:
                self.finish_reasons.append(match.group(1).decode())
        self._tail = data[-_SCAN_OVERLAP:]

    def _note_ids(self, parsed: dict[str, Any]) -> None:
        response_id, model = parsed.get("id"), parsed.get("model")
        if isinstance(response_id, str):
            self.response_id = response_id[:256]
        if isinstance(model, str):
            self.response_model = model[:256]

    def end(self, outcome: Outcome, prompt: int | None, completion: int | None, cached: int | None) -> None:
        """Close the span with what the worker answered and how the attempt ended (token counts
        only when SERVED)."""
        span = self.span
        if not self.recording:
            span.end()
            return
        attributes: dict[str, Any] = {"kvgate.attempt.outcome": outcome.value}
        if self.response_id is not None:
            attributes["gen_ai.response.id"] = self.response_id
        if self.response_model is not None:
            attributes["gen_ai.response.model"] = self.response_model
        if self.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = list(self.finish_reasons)
        if self.status is not None:
            attributes["http.response.status_code"] = self.status
        if outcome is Outcome.SERVED:
            attributes.update(_usage(prompt, completion, cached))
        else:
            attributes["error.type"] = self.error_type or outcome.value
            if outcome is Outcome.WORKER_FAILED:
                span.set_status(Status(StatusCode.ERROR))
        span.set_attributes(attributes)
        span.end()


class TracedSource:
    """A worker's streamed answer (`streaming.StreamSource`) whose chunks are also scanned for
    finish reasons; everything else is passed through."""

    __slots__ = ("_source", "_trace")

    def __init__(self, source: Any, attempt_trace: AttemptTrace) -> None:
        self._source = source
        self._trace = attempt_trace

    @property
    def status(self) -> int:
        status: int = self._source.status
        return status

    @property
    def content_type(self) -> str:
        content_type: str = self._source.content_type
        return content_type

    @property
    def retry_hints(self) -> RetryHints:
        hints: RetryHints = self._source.retry_hints
        return hints

    async def read(self) -> bytes:
        chunk: bytes = await self._source.read()
        if chunk:
            self._trace.scan(chunk)
        return chunk

    async def read_all(self) -> bytes:
        body: bytes = await self._source.read_all()
        return body

    async def read_held(self, held: Reservation) -> AnswerBody:
        body: AnswerBody = await self._source.read_held(held)
        return body

    def release(self) -> None:
        self._source.release()

    def close(self) -> None:
        self._source.close()


def valid_tracestate(header: str) -> bool:
    """Whether a client's `tracestate` (its header fields joined with commas) is one the gateway
    passes on: W3C's grammar, at most `MAX_TRACESTATE_MEMBERS` members, `MAX_TRACESTATE_CHARS`."""
    if len(header) > MAX_TRACESTATE_CHARS:
        return False
    keys: set[str] = set()
    for member in header.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        match = _TRACESTATE_MEMBER.fullmatch(member)
        if match is None or match[1] in keys:
            return False
        keys.add(match[1])
    return len(keys) <= MAX_TRACESTATE_MEMBERS


class RequestTracer:
    """Starts and ends the spans of the completion path (see the module docstring)."""

    def __init__(
        self,
        provider: trace.TracerProvider,
        provider_name: str = "openai",
        shutdown: Callable[[], None] | None = None,
    ) -> None:
        self._tracer = provider.get_tracer("kvgate.gateway", kvgate_version())
        self._provider_name = provider_name
        self._shutdown = shutdown
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_config(cls, config: TracingConfig) -> RequestTracer:
        """A tracer over the SDK set up from the process's `OTEL_*` variables."""
        provider, shutdown = tracer_provider()
        return cls(provider, config.provider_name, shutdown)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter (blocks: call it off the event loop)."""
        if self._shutdown is not None:
            self._shutdown()
            self._shutdown = None

    def wrap(self, handler: ProxyHandler) -> ProxyHandler:
        """`handler` (the completion route) inside a SERVER span that is the current span while it
        runs, child of the client's trace context when the request carries one."""

        async def traced(scope: Scope, receive: Receive, send: Send, endpoint: Any) -> None:
            parent = self._client_context(scope["headers"])
            label = getattr(endpoint, "endpoint", endpoint)  # a route (`routes.ApiRoute`) or its label
            operation = _OPERATION.get(str(label), str(label))
            span = self._tracer.start_span(
                operation,
                context=parent,
                kind=SpanKind.SERVER,
                attributes={
                    "gen_ai.operation.name": operation,
                    "gen_ai.provider.name": self._provider_name,
                    "http.request.method": "POST",
                    "url.path": str(scope["path"]),
                },
            )
            token = otel_context.attach(trace.set_span_in_context(span, parent))
            status = 0

            async def send_watching(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await handler(scope, receive, send_watching, endpoint)
            finally:
                otel_context.detach(token)
                if status:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 400:
                        span.set_attribute("error.type", str(status))
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                span.end()

        return traced

    def _client_context(self, headers: list[tuple[bytes, bytes]]) -> otel_context.Context | None:
        carrier: dict[str, str] = {}
        for name, value in headers:
            if name in _TRACE_HEADERS:
                key = name.decode()
                text = value.decode("latin-1")
                carrier[key] = f"{carrier[key]},{text}" if key in carrier else text
        if "tracestate" in carrier and not valid_tracestate(carrier["tracestate"]):
            del carrier["tracestate"]  # the trace still continues from the `traceparent`
        return self._propagator.extract(carrier) if carrier else None

    def start_attempt(
        self,
        *,
        endpoint: str,
        model: str,
        worker_url: str,
        host: str | None,
        port: int | None,
        policy: str,
        reason: str,
        predicted_cached_tokens: int,
    ) -> AttemptTrace:
        """Open the CLIENT span of an attempt (child of the current SERVER span) and render its
        context as the upstream request's headers."""
        operation = _OPERATION.get(endpoint, "chat")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": self._provider_name,
            "gen_ai.request.model": model,
            "kvgate.route.policy": policy,
            "kvgate.route.reason": reason,
            "kvgate.route.worker": worker_url,
            "kvgate.route.predicted_cached_tokens": predicted_cached_tokens,
        }
        if host is not None:
            attributes["server.address"] = host
        if port is not None:
            attributes["server.port"] = port
        span = self._tracer.start_span(f"{operation} {model}", kind=SpanKind.CLIENT, attributes=attributes)
        carrier = _w3c_headers(span.get_span_context())
        headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in carrier.items())
        return AttemptTrace(span, headers, carrier, span.is_recording())

    def record(self, fields: dict[str, Any]) -> None:
        """The request's outcome on its SERVER span (the current span): model, tenant, retries,
        status. What the worker answered (id, finish reasons, tokens) is on the CLIENT spans: the
        SDK's cost per attribute makes a second copy of each not worth its CPU."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        model = fields.get("model")
        if model is not None:  # a refusal before the served model was known keeps its name
            operation = _OPERATION.get(str(fields.get("endpoint")), "chat")
            span.update_name(f"{operation} {model}")
        attributes: dict[str, Any] = {
            "gen_ai.request.model": model,
            "kvgate.request_id": fields.get("request_id"),
            "kvgate.tenant": fields.get("tenant"),
            "kvgate.retries": fields.get("retries"),
        }
        status = fields.get("status")
        if isinstance(status, int) and status >= 400:
            attributes["error.type"] = str(status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def _w3c_headers(ctx: SpanContext) -> dict[str, str]:
    """`traceparent` (and `tracestate`) of a span context, as the W3C Trace Context spec writes
    them; nothing for an invalid context (the SDK disabled). The trace state was validated when
    the client's header was parsed, so it holds no line break that could end the header block."""
    if not ctx.is_valid:
        return {}
    out = {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    if state and "\r" not in state and "\n" not in state:
        out["tracestate"] = state
    return out


def _usage(prompt: Any, completion: Any, cached: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if prompt is not None:
        out["gen_ai.usage.input_tokens"] = prompt
    if completion is not None:
        out["gen_ai.usage.output_tokens"] = completion
    if cached is not None:
        out["gen_ai.usage.cache_read.input_tokens"] = cached
    return out
