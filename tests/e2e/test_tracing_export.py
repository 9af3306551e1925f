"""`kvgate serve` with `tracing.enabled` exports its spans over OTLP/HTTP to a receiver on
127.0.0.1, and the worker receives a `traceparent` in the client's trace: within 15 s of a
request, and, when the batch delay is longer than the run, at shutdown."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import (
    Proc,
    free_port,
    start_emulator,
    start_fake_workers,
    start_gateway,
    tenant,
    write_gateway_config,
)
from tests.e2e.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # opentelemetry.proto Span.SpanKind values


@dataclass
class Traced:
    base_url: str
    worker_url: str
    gateway: Proc
    receiver: OtlpReceiver


@pytest.fixture()
def traced(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Traced]:
    # The SDK's default batch delay (5 s) unless the test asks for one longer than the run.
    delay_ms, pd = getattr(request, "param", (5000, None))
    yield from _traced(tmp_path, delay_ms, pd)


def _otel_env(receiver: OtlpReceiver, delay_ms: int) -> dict[str, str]:
    """The gateway's OpenTelemetry environment: the SDK exporting to `receiver` in batches every
    `delay_ms`."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=e2e",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": str(delay_ms),
    }


def _traced(tmp_path: Path, delay_ms: int, pd: dict[str, str] | None) -> Iterator[Traced]:
    worker_port, gw_port = free_port(), free_port()
    receiver = OtlpReceiver()
    fake = start_fake_workers({worker_port: "ok"})
    gateway: Proc | None = None
    try:
        worker_url = f"http://127.0.0.1:{worker_port}"
        config = write_gateway_config(
            tmp_path / "gateway.yaml",
            [{"name": "p", "models": ["m"], "workers": [worker_url], **({"pd": pd} if pd else {})}],
            [tenant("acme", "sk-acme")],
            tracing={"enabled": True},
        )
        gateway = start_gateway(config, gw_port, env=_otel_env(receiver, delay_ms))
        yield Traced(f"http://127.0.0.1:{gw_port}", worker_url, gateway, receiver)
    finally:
        if gateway is not None:
            gateway.stop()
        fake.stop()
        receiver.stop()


def _chat(base_url: str, stream: bool) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "a private question"}], "stream": stream}
    headers = {"authorization": "Bearer sk-acme", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    return httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def _request_spans(spans: list[ReceivedSpan]) -> bool:
    kinds = {s.span.kind for s in spans if s.trace_id == TRACE_ID}
    return {SERVER, CLIENT} <= kinds


def _check(spans: list[ReceivedSpan], worker_url: str, traceparent: str | None) -> None:
    (server,) = [s for s in spans if s.span.kind == SERVER]
    (client,) = [s for s in spans if s.span.kind == CLIENT]
    assert server.trace_id == client.trace_id == TRACE_ID
    assert server.parent_span_id == CLIENT_SPAN and client.parent_span_id == server.span_id
    # The worker was sent the CLIENT span's context: the client's trace, the attempt's span.
    assert traceparent == f"00-{TRACE_ID}-{client.span_id}-01"
    assert server.resource["service.name"] == "kvgate"
    assert server.resource["deployment.environment"] == "e2e"
    assert server.resource["service.version"]
    for span in (server, client):
        a = span.attributes
        assert span.span.name == "chat m"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == "m"
        assert "a private question" not in repr(a)
    c = client.attributes
    assert c["gen_ai.response.model"] == "m" and c["gen_ai.response.id"].startswith("cmpl-")
    assert c["gen_ai.response.finish_reasons"] == ["stop"]
    assert c["gen_ai.usage.output_tokens"] == 7 and c["gen_ai.usage.input_tokens"] > 0
    assert "gen_ai.usage.cache_read.input_tokens" in c
    assert c["server.address"] == "127.0.0.1" and f":{c['server.port']}" in worker_url
    assert c["kvgate.route.worker"] == worker_url and c["kvgate.route.policy"] == "cost"
    assert isinstance(c["kvgate.route.reason"], str) and "kvgate.route.predicted_cached_tokens" in c
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["kvgate.tenant"] == "acme"


def _worker_traceparent(worker_url: str) -> str | None:
    requests = httpx.get(worker_url + "/_log", timeout=5).json()["requests"]
    assert len(requests) == 1
    value: str | None = requests[0]["traceparent"]
    return value


# A prefill/decode pool's request run on one worker alone is traced as in a plain pool.
@pytest.mark.parametrize("traced", [(5000, None), (5000, {"mode": "holder_prefill"})], indirect=True)
def test_spans_reach_the_receiver_within_15_s_and_the_worker_joins_the_trace(traced: Traced) -> None:
    assert _chat(traced.base_url, stream=False).status_code == 200
    spans = traced.receiver.wait_for(_request_spans, timeout_s=15.0)
    assert set(traced.receiver.paths) == {"/v1/traces"}
    _check(spans, traced.worker_url, _worker_traceparent(traced.worker_url))


@pytest.mark.parametrize("traced", [(600_000, None)], indirect=True)  # a 10-minute batch delay
def test_a_streams_spans_are_flushed_at_shutdown(traced: Traced) -> None:
    resp = _chat(traced.base_url, stream=True)
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    traceparent = _worker_traceparent(traced.worker_url)
    assert traced.receiver.spans == []  # still in the batch, whose delay outlasts the test
    traced.gateway.popen.send_signal(signal.SIGTERM)
    spans = traced.receiver.wait_for(_request_spans, timeout_s=15.0)
    assert traced.gateway.popen.wait(15) == 0
    _check(spans, traced.worker_url, traceparent)


def test_a_split_request_has_a_client_span_per_leg(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    procs: list[Proc] = []
    gateway: Proc | None = None
    try:
        urls = []
        for role in ("prefill", "decode"):
            url, proc = start_emulator("--host", "127.0.0.1", "--model", "m", "--role", role)
            urls.append(url)
            procs.append(proc)
        pool = {"name": "p", "models": ["m"], "prefill_workers": urls[:1], "decode_workers": urls[1:]}
        config = write_gateway_config(
            tmp_path / "gateway.yaml",
            [{**pool, "pd": {"protocol": "vllm"}}],
            [tenant("acme", "sk-acme")],
            tracing={"enabled": True},
        )
        port = free_port()
        gateway = start_gateway(config, port, env=_otel_env(receiver, 200))
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "a private question " * 40}],
            "stream": True,
        }
        headers = {"authorization": "Bearer sk-acme", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers, timeout=30
        )
        assert resp.status_code == 200

        def both_legs(spans: list[ReceivedSpan]) -> bool:
            return sum(s.span.kind == CLIENT for s in spans) == 2 and any(
                s.span.kind == SERVER for s in spans
            )

        spans = receiver.wait_for(both_legs, timeout_s=15.0)
        (server,) = [s for s in spans if s.span.kind == SERVER]
        legs = {s.attributes["kvgate.route.worker"]: s for s in spans if s.span.kind == CLIENT}
        assert set(legs) == set(urls)
        for leg in legs.values():
            assert leg.trace_id == TRACE_ID and leg.parent_span_id == server.span_id
            assert leg.attributes["http.response.status_code"] == 200
        # The prefill leg answers one token, the decode leg the answer.
        assert legs[urls[0]].attributes["gen_ai.usage.output_tokens"] == 1
        assert legs[urls[1]].attributes["gen_ai.usage.output_tokens"] > 1
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs:
            proc.stop()
        receiver.stop()
