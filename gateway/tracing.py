"""Optional OpenTelemetry spans, one per finished request (off by default).

With `tracing.enabled`, the gateway asks the global tracer provider for a tracer: a no-op unless
the process runs with an OpenTelemetry SDK configured (e.g. under `opentelemetry-instrument` with
`OTEL_TRACES_EXPORTER` / `OTEL_EXPORTER_OTLP_ENDPOINT`). The span is recorded when the request
ends, back-dated to its start, so the hot path pays nothing while the request runs. Attribute
names follow the OpenTelemetry GenAI conventions; content is never attached.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

# GenAI operation names; a route without one is named by its endpoint label (`rerank`, ...).
_OPERATION = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
    "embeddings": "embeddings",
}


class RequestTracer:
    """Turns one request's outcome into a span."""

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self._tracer = tracer or trace.get_tracer("kvgate.gateway")

    def record(self, *, duration_s: float, status: int, attributes: dict[str, Any]) -> None:
        end_ns = time.time_ns()
        start_ns = end_ns - int(duration_s * 1e9)
        endpoint = str(attributes.get("endpoint"))
        operation = _OPERATION.get(endpoint, endpoint)
        span = self._tracer.start_span(
            f"{operation} {attributes.get('model', '')}", kind=SpanKind.SERVER, start_time=start_ns
        )
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("http.response.status_code", status)
        for key, value in _gen_ai(attributes).items():
            if value is not None:
                span.set_attribute(key, value)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
            span.set_attribute("error.type", str(attributes.get("error") or status))
        span.end(end_time=end_ns)


def _gen_ai(a: dict[str, Any]) -> dict[str, Any]:
    return {
        "gen_ai.request.model": a.get("model"),
        "gen_ai.usage.input_tokens": a.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": a.get("completion_tokens"),
        "gen_ai.usage.cache_read.input_tokens": a.get("cached_tokens"),
        "kvgate.request_id": a.get("request_id"),
        "kvgate.tenant": a.get("tenant"),
        "kvgate.worker": a.get("worker"),
        "kvgate.route.reason": a.get("reason"),
        "kvgate.retries": a.get("retries"),
        "kvgate.ttft_ms": a.get("ttft_ms"),
    }
