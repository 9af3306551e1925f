"""What a request's spans say about how it ended, against its access line: a refused request's
SERVER span carries its request id (and its tenant once known), so the two join; a stream that
failed after its 200 head has the error event's status on its SERVER span, as on its line, and
its CLIENT span names the code the client got."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.state import GatewayState
from gateway.tracing import RequestTracer
from policies.config import PolicyConfig, build_policy
from tests.gateway.access_lines import AccessLines, capture_access
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app

SECRET = b"k"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def _chunk(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _worker() -> tuple[web.AppRunner, int]:
    """A worker whose streams break after their first event (the connection closed mid-answer)."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        choice = {"index": 0, "delta": {"content": "a"}, "finish_reason": None}
        await resp.write(_chunk({"id": "c1", "model": "m", "choices": [choice]}))
        assert request.transport is not None
        request.transport.close()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return await serve_app(app)


class Traced:
    def __init__(self, client: httpx.AsyncClient, state: GatewayState, spans: InMemorySpanExporter) -> None:
        self.client, self.state, self.spans = client, state, spans
        self.lines: AccessLines = capture_access(state)

    def server(self) -> ReadableSpan:
        (span,) = [s for s in self.spans.get_finished_spans() if s.kind is SpanKind.SERVER]
        self.spans.clear()
        return span

    async def post(self, body: dict[str, Any], key: str) -> tuple[httpx.Response, dict[str, Any]]:
        resp = await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        return resp, self.lines.of(resp.headers["x-request-id"])


@pytest.fixture
async def traced() -> AsyncIterator[Traced]:
    runner, port = await _worker()
    config = parse_config(
        {
            "pools": [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{port}"]}],
            "tenants": [
                {"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]},
                {"name": "q", "api_key_hashes": [hash_api_key(SECRET, "sk-q")], "quotas": {"tpm": 1}},
            ],
            "scrape": {"enabled": False},
        }
    )
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = RequestTracer(provider, "openai", provider.shutdown)
    policy = build_policy(PolicyConfig(policy="round_robin"))
    try:
        async with gateway_in_process(config, policy, secret=SECRET, tracer=tracer) as gw:
            yield Traced(gw.client, gw.state, spans)
    finally:
        await runner.cleanup()


async def test_a_refused_requests_server_span_joins_its_access_line(traced: Traced) -> None:
    cases = [
        ("sk-wrong", CHAT, 401, None, None),  # the key names no tenant
        ("sk-t", {**CHAT, "model": "nope"}, 404, "t", None),  # the client's model is not a name
        ("sk-t", {**CHAT, "messages": "x"}, 400, "t", None),
        ("sk-q", {**CHAT, "messages": [{"role": "user", "content": "x " * 50}]}, 429, "q", "m"),
    ]
    for key, body, status, tenant, model in cases:
        resp, line = await traced.post(body, key)
        assert (resp.status_code, line["status"], line["tenant"], line["model"]) == (
            status,
            status,
            tenant,
            model,
        )
        span = traced.server()
        attrs = dict(span.attributes or {})
        assert attrs["kvgate.request_id"] == line["request_id"]
        assert attrs.get("kvgate.tenant") == tenant
        assert attrs.get("gen_ai.request.model") == model
        assert attrs["error.type"] == str(status) and attrs["http.response.status_code"] == status
        assert span.name == ("chat m" if model else "chat")


async def test_a_stream_that_fails_after_its_head_has_the_error_events_status(traced: Traced) -> None:
    resp, line = await traced.post({**CHAT, "stream": True}, "sk-t")
    assert resp.status_code == 200 and "upstream_stream_error" in resp.text  # the error event
    assert (line["status"], line["error"]) == (502, "upstream_stream_error")
    (client,) = [s for s in traced.spans.get_finished_spans() if s.kind is SpanKind.CLIENT]
    server = traced.server()
    s, c = dict(server.attributes or {}), dict(client.attributes or {})
    # The HTTP status is the head's; `error.type` and the span status are the error event's.
    assert s["http.response.status_code"] == 200 and s["error.type"] == "502"
    assert server.status.status_code is StatusCode.ERROR
    assert s["kvgate.request_id"] == line["request_id"]
    assert c["kvgate.attempt.outcome"] == "worker_failed"
    assert c["error.type"] == "upstream_stream_error"  # the code the client got, not the outcome
    assert client.status.status_code is StatusCode.ERROR
