"""Prometheus metrics of one gateway process (own registry, so tests can build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """Request, latency, routing and token metrics. Labels stay low-cardinality: model, tenant,
    status, policy, reason, worker — never request content."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests", "Finished requests", ["model", "tenant", "status", "endpoint"], registry=r
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Gateway-measured TTFT of streamed requests",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.duration = Histogram(
            "kvgate_request_duration_seconds",
            "Time from request to last byte",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decisions = Counter(
            "kvgate_routing_decisions", "Routing decisions", ["policy", "reason"], registry=r
        )
        self.retries = Counter(
            "kvgate_upstream_retries", "Requests re-sent to another worker", ["pool"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens", "Prompt tokens reported by workers", ["model", "tenant"], registry=r
        )
        self.cached_tokens = Counter(
            "kvgate_cached_prompt_tokens",
            "Cached prompt tokens reported by workers",
            ["model", "tenant"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvgate_completion_tokens",
            "Completion tokens reported by workers",
            ["model", "tenant"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvgate_worker_in_flight", "Gateway in-flight requests per worker", ["pool", "worker"], registry=r
        )
        self.worker_healthy = Gauge(
            "kvgate_worker_healthy", "1 if the worker is routable", ["pool", "worker"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
