"""The OpenTelemetry SDK of a gateway with `tracing.enabled`, set up from the standard `OTEL_*`
variables, and the check that names the `kvgate[otel]` extra when its packages are missing.

The base install carries only the OpenTelemetry API; the SDK and its OTLP exporter come with
`pip install 'kvgate[otel]'`. The config checks for them when it is loaded (without importing
them, so a load stays cheap), so a missing package or an exporter kvgate cannot build stops
start-up with a message instead of dropping every span.

What the process reads, as any OpenTelemetry SDK does:
- `OTEL_TRACES_EXPORTER`: `otlp` (the default), `console` (spans as JSON on stdout) or `none`;
- `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf` (the
  default, and the one protocol kvgate's extra brings);
- the exporter's own `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`, `_HEADERS`, `_TIMEOUT`,
  `_COMPRESSION` and certificate variables;
- `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (over the defaults `service.name=kvgate`
  and `service.version=<kvgate's version>`);
- `OTEL_TRACES_SAMPLER` / `_ARG`, the `OTEL_BSP_*` batch settings and `OTEL_SPAN_*` limits;
- `OTEL_SDK_DISABLED=true`: no SDK; spans are no-ops and nothing is exported.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider as ApiTracerProvider

OTEL_EXTRA = "kvgate[otel]"
SERVICE_NAME = "kvgate"
_SDK_MODULES = {
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.exporter.otlp.proto.http": "opentelemetry-exporter-otlp-proto-http",
}
_PROTOCOL = "http/protobuf"
_EXPORTERS = ("otlp", "console", "none")


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _exporter_name(environ: Mapping[str, str]) -> str:
    return environ.get("OTEL_TRACES_EXPORTER", "").strip() or "otlp"


def _protocol(environ: Mapping[str, str]) -> str:
    value = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return (value or _PROTOCOL).strip()


def tracing_unavailable(environ: Mapping[str, str]) -> str | None:
    """None when tracing can run here as `environ` asks, else what is wrong and how to fix it."""
    if sdk_disabled(environ):
        return None
    missing = [dist for module, dist in _SDK_MODULES.items() if not _present(module)]
    if missing:
        return f"tracing needs {' and '.join(missing)}: pip install '{OTEL_EXTRA}'"
    exporter = _exporter_name(environ)
    if exporter not in _EXPORTERS:
        return f"OTEL_TRACES_EXPORTER={exporter!r} is not supported: use one of {', '.join(_EXPORTERS)}"
    protocol = _protocol(environ)
    if exporter == "otlp" and protocol != _PROTOCOL:
        return (
            f"OTLP protocol {protocol!r} (OTEL_EXPORTER_OTLP_PROTOCOL) is not supported: "
            f"use {_PROTOCOL} (a collector's port 4318)"
        )
    return None


def kvgate_version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"


def tracer_provider(
    environ: Mapping[str, str] = os.environ,
) -> tuple[ApiTracerProvider, Callable[[], None]]:
    """A tracer provider configured from the process environment (`environ` picks the exporter;
    the SDK's own parts read `os.environ`), and the call that flushes and stops it: it blocks
    while the last batch is exported, so run it off the event loop."""
    from opentelemetry.trace import NoOpTracerProvider

    if sdk_disabled(environ):
        return NoOpTracerProvider(), lambda: None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    defaults = Resource.create({"service.name": SERVICE_NAME, "service.version": kvgate_version()})
    # The variables win over the defaults (Resource.create puts its argument last).
    provider = TracerProvider(resource=defaults.merge(OTELResourceDetector().detect()))
    exporter: SpanExporter | None = None
    name = _exporter_name(environ)
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    elif name == "console":
        exporter = ConsoleSpanExporter()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider, provider.shutdown
