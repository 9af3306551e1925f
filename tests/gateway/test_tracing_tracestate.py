"""A client's `tracestate` the gateway will not pass on (outside W3C's grammar or bounds) is
dropped before the OpenTelemetry API parses it, whose warning would quote the client's whole
header, once per request; the client's `traceparent` still makes the SERVER span its child."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext
from starlette.types import Message, Receive, Scope, Send

from gateway.tracing import RequestTracer

# W3C's bounds, as the gateway keeps them (`tracing.MAX_TRACESTATE_*`).
MAX_TRACESTATE_CHARS = 8192
MAX_TRACESTATE_MEMBERS = 32

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


async def _receive() -> Message:
    return {"type": "http.disconnect"}


async def _send(message: Message) -> None:
    pass


async def _handler(scope: Scope, receive: Receive, send: Send, endpoint: object) -> None:
    pass


async def _parent(*tracestate: str) -> SpanContext:
    """The parent of the SERVER span of a request with the client's `traceparent` and these
    `tracestate` header fields."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    headers = [(b"traceparent", TRACEPARENT.encode())]
    headers += [(b"tracestate", field.encode("latin-1")) for field in tracestate]
    scope = {"type": "http", "path": "/v1/chat/completions", "headers": headers}
    await RequestTracer(provider).wrap(_handler)(scope, _receive, _send, "chat")
    (span,) = spans.get_finished_spans()
    assert span.parent is not None
    assert f"{span.parent.trace_id:032x}" == TRACE_ID and f"{span.parent.span_id:016x}" == CLIENT_SPAN
    return span.parent


def _members(n: int) -> str:
    return ",".join(f"k{i}=v" for i in range(n))


@pytest.mark.parametrize(
    "tracestate",
    [
        "x=" + "s" * 5000,  # a member's value past 256 characters
        ",".join(f"k{i}=" + "s" * 256 for i in range(MAX_TRACESTATE_MEMBERS)),  # each fine, too long together
        _members(MAX_TRACESTATE_MEMBERS + 1),
        "Vendor=abc",  # keys are lower case
        "vendor=abc,vendor=def",  # and unique
        "vendor=a=b",  # a value has no '='
        "vendor=abc \x00",
        "vendor=caf\xe9",
        "vendor",
        "t@longer-than-14-chars=v",  # a system id of at most 14
    ],
)
async def test_a_tracestate_not_passed_on_is_dropped_unlogged_and_the_trace_continues(
    tracestate: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        parent = await _parent(tracestate)
    assert len(parent.trace_state) == 0
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")], caplog.text


@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        (["vendor=abc"], {"vendor": "abc"}),
        (["a=1 , ,b=x y", "c@sys=2"], {"a": "1", "b": "x y", "c@sys": "2"}),  # fields joined
        ([_members(MAX_TRACESTATE_MEMBERS)], {f"k{i}": "v" for i in range(MAX_TRACESTATE_MEMBERS)}),
        (["vendor=" + "s" * 250 + ",other=" + "s" * 250], {"vendor": "s" * 250, "other": "s" * 250}),
        # Past the 512 characters W3C asks everyone to keep: 20 members of 34 characters, kept whole.
        ([",".join(f"m{i:02d}=" + "x" * 30 for i in range(20))], {f"m{i:02d}": "x" * 30 for i in range(20)}),
    ],
)
async def test_a_valid_tracestate_reaches_the_span(
    fields: list[str], kept: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        parent = await _parent(*fields)
    assert dict(parent.trace_state) == kept
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")], caplog.text
