from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gateway.tracing import RequestTracer


def test_one_backdated_genai_span_per_request_without_content() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider.get_tracer("test"))
    fields = {
        "request_id": "r1",
        "tenant": "acme",
        "model": "m",
        "endpoint": "chat",
        "status": 200,
        "worker": "http://w:1",
        "reason": "hit",
        "retries": 0,
        "prompt_tokens": 100,
        "cached_tokens": 96,
        "completion_tokens": 7,
        "ttft_ms": 12.5,
        "error": None,
    }
    tracer.record(duration_s=0.25, status=200, attributes=fields)
    tracer.record(duration_s=0.1, status=502, attributes={**fields, "error": "upstream_stream_error"})
    ok, failed = exporter.get_finished_spans()
    assert ok.name == "chat m"
    assert ok.end_time is not None and ok.start_time is not None
    assert abs((ok.end_time - ok.start_time) / 1e9 - 0.25) < 0.01
    attrs = dict(ok.attributes or {})
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 96 and attrs["kvgate.route.reason"] == "hit"
    assert all("content" not in k and "messages" not in k for k in attrs)
    assert failed.status.status_code is StatusCode.ERROR
    assert dict(failed.attributes or {})["error.type"] == "upstream_stream_error"
