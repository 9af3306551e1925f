"""Prometheus metrics of one gateway process (own registry, so tests can build several apps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

        # Label children cached per label tuple: prometheus_client's labels() takes a lock and
        # builds a key on every call. Label values come from the config, so the caches are bounded.
        self._per_model: dict[tuple[str, str], _ModelChildren] = {}
        self._status: dict[tuple[str, str, str, str], Any] = {}

    def rejected(self, endpoint: str, status: int) -> None:
        """A request refused before it was tied to a known model and tenant."""
        self._status_child("", "", status, endpoint).inc()

    def observe(
        self,
        *,
        model: str,
        tenant: str,
        endpoint: str,
        status: int,
        duration_s: float,
        ttft_s: float | None,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        self._status_child(model, tenant, status, endpoint).inc()
        children = self._per_model.get((model, tenant))
        if children is None:
            children = _ModelChildren(
                self.duration.labels(model),
                self.ttft.labels(model),
                self.prompt_tokens.labels(model, tenant),
                self.cached_tokens.labels(model, tenant),
                self.completion_tokens.labels(model, tenant),
            )
            self._per_model[(model, tenant)] = children
        children.duration.observe(duration_s)
        if ttft_s is not None:
            children.ttft.observe(ttft_s)
        if prompt_tokens:
            children.prompt.inc(prompt_tokens)
        if cached_tokens:
            children.cached.inc(cached_tokens)
        if completion_tokens:
            children.completion.inc(completion_tokens)

    def decision(self, policy: str, reason: str) -> None:
        key = ("decision", policy, reason, "")
        child = self._status.get(key)
        if child is None:
            child = self._status[key] = self.decisions.labels(policy, reason)
        child.inc()

    def _status_child(self, model: str, tenant: str, status: int, endpoint: str) -> Any:
        key = (model, tenant, str(status), endpoint)
        child = self._status.get(key)
        if child is None:
            child = self._status[key] = self.requests.labels(model, tenant, str(status), endpoint)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class _ModelChildren:
    duration: Any
    ttft: Any
    prompt: Any
    cached: Any
    completion: Any
