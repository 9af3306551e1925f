"""Prometheus metrics of one gateway process (own registry, so tests can build several apps).

The per-request series (requests, latencies, tokens, decisions, retries) are plain numbers per
label tuple, written only from the event loop and turned into Prometheus families when scraped:
prometheus_client's own counters take a lock and a label lookup on every increment, which was a
measurable share of the gateway's CPU per request. Gauges, set only at scrape time, stay
prometheus_client's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """Request, latency, routing and token metrics. Labels stay low-cardinality: model, tenant,
    status, policy, reason, worker — never request content."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        hot = _HotCollector()
        self.requests = hot.counter(
            "kvgate_requests", "Finished requests", ("model", "tenant", "status", "endpoint")
        )
        self.ttft = hot.histogram(
            "kvgate_time_to_first_token_seconds",
            "Gateway-measured TTFT of streamed requests",
            ("model",),
            _LATENCY_BUCKETS_S,
        )
        self.duration = hot.histogram(
            "kvgate_request_duration_seconds",
            "Time from request to last byte",
            ("model",),
            _LATENCY_BUCKETS_S,
        )
        self.decisions = hot.counter("kvgate_routing_decisions", "Routing decisions", ("policy", "reason"))
        self.retries = hot.counter(
            "kvgate_upstream_retries",
            "Requests re-sent to another worker, by why the previous attempt failed",
            ("pool", "reason"),
        )
        self.prompt_tokens = hot.counter(
            "kvgate_prompt_tokens", "Prompt tokens reported by workers", ("model", "tenant")
        )
        self.cached_tokens = hot.counter(
            "kvgate_cached_prompt_tokens", "Cached prompt tokens reported by workers", ("model", "tenant")
        )
        self.completion_tokens = hot.counter(
            "kvgate_completion_tokens", "Completion tokens reported by workers", ("model", "tenant")
        )
        self.discovery_errors = hot.counter(
            "kvgate_discovery_errors",
            "Failed worker-discovery lookups, lists and watches",
            ("pool", "reason"),
        )
        self.discovery_resyncs = hot.counter(
            "kvgate_discovery_resyncs",
            "Full re-lists of a pool's workers after a watch ended in error",
            ("pool",),
        )
        self.pd_requests = hot.counter(
            "kvgate_pd_requests",
            "Requests sent to the workers of prefill/decode pools, by the part the worker played "
            "(prefill, decode, or alone: the whole request)",
            ("pool", "role"),
        )
        self.pd_transfers = hot.counter(
            "kvgate_pd_transfers",
            "Decode requests sent to read a prompt's KV from a prefill worker",
            ("pool",),
        )
        self.pd_transfer_failures = hot.counter(
            "kvgate_pd_transfer_failures",
            "Decode requests whose KV transfer failed (decode_error: the worker said so; timeout)",
            ("pool", "reason"),
        )
        self.pd_skipped_splits = hot.counter(
            "kvgate_pd_skipped_splits",
            "Requests of prefill/decode pools served by one worker alone (sooner: scored better than "
            "any split; no_pair: no pair available; unsplittable: several sequences; "
            "transfer_failed: recomputed)",
            ("pool", "reason"),
        )
        r.register(hot)
        self.discovered_workers = Gauge(
            "kvgate_discovery_workers", "Workers a pool's discovery currently reports", ["pool"], registry=r
        )
        self.in_flight = Gauge(
            "kvgate_worker_in_flight", "Gateway in-flight requests per worker", ["pool", "worker"], registry=r
        )
        self.worker_waiting = Gauge(
            "kvgate_worker_requests_waiting",
            "The worker's own waiting-queue length, from its last fresh /metrics scrape",
            ["pool", "worker"],
            registry=r,
        )
        self.worker_kv_usage = Gauge(
            "kvgate_worker_kv_cache_usage",
            "The worker's KV-cache usage (0-1), from its last fresh /metrics scrape",
            ["pool", "worker"],
            registry=r,
        )
        self.policy_counters = Gauge(
            "kvgate_policy_counter",
            "The routing policy's own counters (KV events applied, promotions, ...)",
            ["policy", "counter"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "kvgate_worker_healthy", "1 if the worker is routable", ["pool", "worker"], registry=r
        )

        # The children of one (model, tenant), fetched together. Label values come from the config
        # (and a small set of statuses), so every map of children stays bounded.
        self._per_model: dict[tuple[str, str], _ModelChildren] = {}

    def rejected(self, endpoint: str, status: int) -> None:
        """A request refused before it was tied to a known model and tenant."""
        self.requests.labels("", "", str(status), endpoint).inc()

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
        self.requests.labels(model, tenant, str(status), endpoint).inc()
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
        self.decisions.labels(policy, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class _ModelChildren:
    duration: HistogramChild
    ttft: HistogramChild
    prompt: CounterChild
    cached: CounterChild
    completion: CounterChild


class CounterChild:
    """One label tuple's running total."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """One label tuple's bucket counts (not cumulative: made so at scrape time), sum and count."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is the +Inf bucket
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # first bucket whose bound is >= value
        self.sum += value


class HotCounter:
    """A counter family: `labels(...)` gives the child of one label tuple (created once)."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.children: dict[tuple[str, ...], CounterChild] = {}

    def labels(self, *values: str) -> CounterChild:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = CounterChild()
        return child

    def metric(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, child.value)
        return family


class HotHistogram:
    """A histogram family with fixed bucket bounds (seconds)."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], bounds: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = tuple(bounds)
        self.children: dict[tuple[str, ...], HistogramChild] = {}

    def labels(self, *values: str) -> HistogramChild:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = HistogramChild(self.bounds)
        return child

    def metric(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip((*self.bounds, float("inf")), child.counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric(values, buckets, child.sum)
        return family


class _HotCollector(Collector):
    """Exports the hot families at scrape time."""

    def __init__(self) -> None:
        self._families: list[HotCounter | HotHistogram] = []

    def counter(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> HotCounter:
        family = HotCounter(name, documentation, labelnames)
        self._families.append(family)
        return family

    def histogram(
        self, name: str, documentation: str, labelnames: tuple[str, ...], bounds: Sequence[float]
    ) -> HotHistogram:
        family = HotHistogram(name, documentation, labelnames, bounds)
        self._families.append(family)
        return family

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.metric()
