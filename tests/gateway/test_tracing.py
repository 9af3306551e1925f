"""Traces of the completion path, in process: a SERVER span per request (child of the client's
`traceparent`), a CLIENT span per attempt whose context reaches the worker, GenAI and routing
attributes, never content. Spans go to an in-memory exporter; the worker is an aiohttp app on
127.0.0.1 that records the headers it was sent."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from gateway.app import GatewayApp, build_app
from gateway.auth import hash_api_key
from gateway.config import TracingConfig, parse_config
from gateway.otel_sdk import tracing_unavailable
from gateway.state import GatewayState, build_state
from gateway.tracing import AttemptTrace, RequestTracer
from policies.config import PolicyConfig, build_policy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.support.inprocess import every_worker_up, gateway_in_process
from tests.support.loopback import serve_app

SECRET = b"k"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
PROMPT = "a secret prompt that must never reach a span"


@dataclass
class Worker:
    """What the scripted worker saw; `fail_first` answers 500 to that many requests."""

    headers: list[dict[str, str]] = field(default_factory=list)
    fail_first: int = 0


@dataclass
class Rig:
    client: httpx.AsyncClient
    worker: Worker
    state: GatewayState
    app: GatewayApp
    spans: InMemorySpanExporter
    worker_port: int

    async def chat(self, *, stream: bool = False, headers: dict[str, str] | None = None) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": stream}
        return await self.client.post(
            "/v1/chat/completions",
            json=body,
            headers={"authorization": "Bearer sk-t", **(headers or {})},
        )

    def finished(self, kind: SpanKind) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.kind is kind]


def _chunk(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _start_worker(worker: Worker) -> tuple[web.AppRunner, int]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        worker.headers.append(dict(request.headers))
        if worker.fail_first:
            worker.fail_first -= 1
            return web.json_response({"error": {"message": "boom"}}, status=500)
        usage = {"prompt_tokens": 20, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 16}}
        base = {"id": "chatcmpl-42", "model": "m-served", "object": "chat.completion"}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            return web.json_response({**base, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for word, finish in (("a", None), ("b", None), ("c", "length")):
            choice = {"index": 0, "delta": {"content": word}, "finish_reason": finish}
            await resp.write(_chunk({**base, "choices": [choice]}))
        await resp.write(_chunk({**base, "choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return await serve_app(app)


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    worker = Worker()
    runner, port = await _start_worker(worker)
    config = parse_config(
        {
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "workers": [f"http://127.0.0.1:{port}", f"http://localhost:{port}"],
                    "retry_attempts": 1,
                    "breaker": {"failure_threshold": 100},
                }
            ],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
            "scrape": {"enabled": False},
        }
    )
    spans = InMemorySpanExporter()
    provider = TracerProvider(sampler=getattr(request, "param", None))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    state = build_state(config, SECRET, build_policy(PolicyConfig(policy="round_robin")), NormalizerConfig())
    state.routing.tracer = RequestTracer(provider, "openai", provider.shutdown)
    app = build_app(state)
    try:
        async with (
            app.fallback.router.lifespan_context(app.fallback),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
        ):
            await every_worker_up(state)
            yield Rig(client, worker, state, app, spans, port)
    finally:
        await runner.cleanup()


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _no_content(spans: list[ReadableSpan]) -> None:
    for span in spans:
        assert not any(PROMPT in str(v) or v == "hi" for v in _attrs(span).values())
        assert not any("message" in k or "content" in k for k in _attrs(span))


async def test_the_client_trace_continues_through_the_gateway_to_the_worker(rig: Rig) -> None:
    resp = await rig.chat(headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
    assert resp.status_code == 200
    (server,) = rig.finished(SpanKind.SERVER)
    (client,) = rig.finished(SpanKind.CLIENT)
    # The client's span is the SERVER span's parent; the attempt is the SERVER span's child.
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert server.parent is not None and f"{server.parent.span_id:016x}" == CLIENT_SPAN
    assert client.parent is not None and client.parent.span_id == server.context.span_id
    # The worker was sent the attempt's own context, in the client's trace, with its tracestate.
    sent = rig.worker.headers[-1]
    assert sent["traceparent"] == f"00-{TRACE_ID}-{client.context.span_id:016x}-01"
    assert sent["tracestate"] == "vendor=abc"

    assert server.name == client.name == "chat m"
    s, c = _attrs(server), _attrs(client)
    for attrs in (s, c):
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == "openai"
        assert attrs["gen_ai.request.model"] == "m"
    assert s["http.response.status_code"] == 200 and s["kvgate.tenant"] == "t"
    assert s["kvgate.retries"] == 0 and "error.type" not in s
    assert c["gen_ai.response.id"] == "chatcmpl-42"
    assert c["gen_ai.response.model"] == "m-served"
    assert c["gen_ai.response.finish_reasons"] == ("stop",)
    assert c["gen_ai.usage.input_tokens"] == 20
    assert c["gen_ai.usage.output_tokens"] == 3
    assert c["gen_ai.usage.cache_read.input_tokens"] == 16  # the actual cached tokens
    assert c["server.port"] == rig.worker_port and c["server.address"] in ("127.0.0.1", "localhost")
    assert c["kvgate.route.policy"] == "round_robin"
    assert c["kvgate.route.worker"] in [w.url for w in rig.state.registry.pools["p"].workers.values()]
    assert c["kvgate.route.predicted_cached_tokens"] == 0  # round robin predicts nothing
    assert c["kvgate.attempt.outcome"] == "served" and c["http.response.status_code"] == 200
    _no_content([server, client])


async def test_a_request_without_trace_context_starts_a_trace(rig: Rig) -> None:
    assert (await rig.chat()).status_code == 200
    (server,) = rig.finished(SpanKind.SERVER)
    (client,) = rig.finished(SpanKind.CLIENT)
    assert server.parent is None and client.parent is not None
    assert rig.worker.headers[-1]["traceparent"].split("-")[1] == f"{server.context.trace_id:032x}"
    assert "tracestate" not in rig.worker.headers[-1]


async def test_a_stream_reports_its_finish_reasons_and_time_per_output_token(rig: Rig) -> None:
    resp = await rig.chat(stream=True, headers={"traceparent": TRACEPARENT})
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    (server,) = rig.finished(SpanKind.SERVER)
    (client,) = rig.finished(SpanKind.CLIENT)
    attrs = _attrs(client)
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.response.id"] == "chatcmpl-42"
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert _attrs(server)["http.response.status_code"] == 200
    _no_content([server, client])
    metrics = {
        s.name: s.value
        for family in text_string_to_metric_families(rig.state.routing.metrics.render().decode())
        for s in family.samples
        if s.labels.get("model") == "m"
    }
    assert metrics["kvgate_request_time_per_output_token_seconds_count"] == 1


async def test_each_attempt_is_its_own_client_span(rig: Rig) -> None:
    rig.worker.fail_first = 1
    assert (await rig.chat(headers={"traceparent": TRACEPARENT})).status_code == 200
    (server,) = rig.finished(SpanKind.SERVER)
    failed, served = rig.finished(SpanKind.CLIENT)
    assert failed.status.status_code is StatusCode.ERROR
    assert _attrs(failed)["error.type"] == "worker_error"
    assert _attrs(failed)["kvgate.attempt.outcome"] == "worker_failed"
    assert _attrs(failed)["http.response.status_code"] == 500
    assert _attrs(served)["kvgate.attempt.outcome"] == "served"
    assert {failed.parent.span_id, served.parent.span_id} == {server.context.span_id}  # type: ignore[union-attr]
    # Each attempt sent its own span's context.
    sent = [h["traceparent"].split("-")[2] for h in rig.worker.headers]
    assert sent == [f"{failed.context.span_id:016x}", f"{served.context.span_id:016x}"]
    assert _attrs(server)["kvgate.retries"] == 1
    assert server.status.status_code is StatusCode.UNSET


async def test_a_rejected_request_still_gets_its_server_span(rig: Rig) -> None:
    resp = await rig.client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": []},
        headers={"authorization": "Bearer wrong", "traceparent": TRACEPARENT},
    )
    assert resp.status_code == 401
    (server,) = rig.finished(SpanKind.SERVER)
    assert rig.finished(SpanKind.CLIENT) == []
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert _attrs(server)["http.response.status_code"] == 401
    assert _attrs(server)["error.type"] == "401"
    assert server.status.status_code is StatusCode.UNSET  # a client error is not the server's


@pytest.mark.parametrize("rig", [ALWAYS_OFF], indirect=True)
async def test_a_request_the_sampler_drops_still_passes_its_trace_on(rig: Rig) -> None:
    unsampled = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
    assert (await rig.chat(stream=True, headers={"traceparent": unsampled})).is_success
    assert rig.spans.get_finished_spans() == ()
    version, trace_id, span_id, flags = rig.worker.headers[-1]["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "00") and span_id != CLIENT_SPAN


async def test_a_malformed_traceparent_is_ignored(rig: Rig) -> None:
    assert (await rig.chat(headers={"traceparent": "00-zz-nonsense-01"})).status_code == 200
    (server,) = rig.finished(SpanKind.SERVER)
    assert server.parent is None
    assert rig.worker.headers[-1]["traceparent"].split("-")[1] == f"{server.context.trace_id:032x}"


async def test_with_tracing_off_the_worker_gets_no_trace_headers() -> None:
    worker = Worker()
    runner, port = await _start_worker(worker)
    config = parse_config(
        {
            "pools": [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{port}"]}],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
            "scrape": {"enabled": False},
        }
    )
    try:
        async with gateway_in_process(
            config, build_policy(PolicyConfig(policy="round_robin")), secret=SECRET
        ) as gw:
            assert gw.state.routing.tracer is None
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            headers = {"authorization": "Bearer sk-t", "traceparent": TRACEPARENT}
            assert (
                await gw.client.post("/v1/chat/completions", json=body, headers=headers)
            ).status_code == 200
    finally:
        await runner.cleanup()
    assert "traceparent" not in worker.headers[-1] and "tracestate" not in worker.headers[-1]


def test_finish_reasons_cut_between_chunks_are_found_once() -> None:
    from opentelemetry.trace import INVALID_SPAN

    trace = AttemptTrace(INVALID_SPAN, b"", {})
    event = b'data: {"choices":[{"index":0,"finish_reason":"stop"}]}\n\n'
    cut = event.index(b"sto")
    trace.scan(b'data: {"choices":[{"finish_reason":null}]}\n\n' + event[:cut])
    trace.scan(event[cut:])
    trace.scan(b'data: {"choices":[{"index":1,"finish_reason":"length"}]}\n\n')
    assert trace.finish_reasons == ["stop", "length"]


def test_a_streams_id_and_model_come_from_its_first_data_event() -> None:
    from opentelemetry.trace import INVALID_SPAN

    trace = AttemptTrace(INVALID_SPAN, b"", {})
    first = b': ping\n\nid: 1\ndata: {"id":"chatcmpl-9","model":"m2"}\n\ndata: {"id":"x"}\n\n'
    trace.note_first_events(first)
    assert (trace.response_id, trace.response_model) == ("chatcmpl-9", "m2")


@pytest.mark.parametrize(
    ("environ", "problem"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_TRACES_EXPORTER": "otlp"}, None),
        ({"OTEL_TRACES_EXPORTER": "console"}, None),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTLP protocol 'grpc'"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTLP protocol 'http/json'"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin' is not supported"),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, None),
    ],
)
def test_what_the_environment_asks_for_is_checked(environ: dict[str, str], problem: str | None) -> None:
    found = tracing_unavailable(environ)
    assert found == problem if problem is None else (found is not None and problem in found)


def test_tracing_without_the_extra_fails_at_config_load_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http", None)
    with pytest.raises(ValidationError) as err:
        TracingConfig(enabled=True)
    needs = "tracing needs opentelemetry-exporter-otlp-proto-http: pip install 'kvgate[otel]'"
    assert needs in str(err.value)
    assert TracingConfig(enabled=False).enabled is False  # off, nothing is needed


def test_the_config_check_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(os.environ, "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ValidationError, match="use http/protobuf"):
        TracingConfig(enabled=True)
