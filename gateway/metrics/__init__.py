"""Prometheus metrics of one gateway process (own registry, so tests can build several apps).

The per-request series (requests, latencies, tokens, decisions, retries) are plain numbers per
label tuple, written only from the event loop and turned into Prometheus families when scraped:
prometheus_client's own counters take a lock and a label lookup on every increment, which was a
measurable share of the gateway's CPU per request. Gauges, set only at scrape time, stay
prometheus_client's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.breaker import BreakerState
from policies.base import Outcome

_SYNC_LAG_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# vLLM's buckets for its time-per-output-token histograms, so gateway and engine panels line up.
_TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
BREAKER_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
_QUEUE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """Request, latency, routing and token metrics, and the process's own (`process_*`,
    `python_*`). Labels stay low-cardinality: model, tenant, status, policy, reason, pool, worker —
    never request content. Series labelled by worker are dropped when the worker leaves its pool
    (`forget_workers`), so discovery's churn does not grow them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
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
        self.tpot = hot.histogram(
            "kvgate_request_time_per_output_token_seconds",
            "Streamed requests' decode time per output token after the first (first chunk to end)",
            ("model",),
            _TPOT_BUCKETS_S,
        )
        self.worker_requests = hot.counter(
            "kvgate_worker_requests",
            "Requests sent to a worker (each attempt), by how they ended: served, rejected (4xx), "
            "worker_failed, aborted",
            ("pool", "worker", "outcome"),
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
        self.pd_ttft = hot.histogram(
            "kvgate_pd_time_to_first_token_seconds",
            "Legs of prefill/decode pools: from dispatch to the worker's first token, by role (prefill: "
            "its whole answer; decode: after the KV transfer; alone: the whole request's TTFT)",
            ("pool", "role"),
            _LATENCY_BUCKETS_S,
        )
        self.pd_transfer_time = hot.histogram(
            "kvgate_pd_transfer_seconds",
            "KV transfers as the gateway sees them: vLLM, the decode leg's dispatch to its first "
            "token; SGLang, the prefill leg's answer to the decode leg's first token",
            ("pool",),
            _LATENCY_BUCKETS_S,
        )
        self.pd_transfer_outcomes = hot.counter(
            "kvgate_pd_transfer_outcomes",
            "KV transfers by how they ended (ok, decode_error, timeout), and requests recomputed "
            "on one worker alone after their transfer failed (recomputed)",
            ("pool", "outcome"),
        )
        self.pd_leg_failures = hot.counter(
            "kvgate_pd_leg_failures",
            "Legs of prefill/decode pools that failed before the client had anything, by role "
            "(prefill, decode, alone) and reason (the retry reason, or the error code)",
            ("pool", "role", "reason"),
        )
        self.client_refusals = hot.counter(
            "kvgate_client_refusals",
            "Client connections closed by a limit before their request reached the gateway, by reason"
            " (header_too_large, too_many_headers, header_timeout, body_timeout, connection_limit)",
            ("reason",),
        )
        self.sync_lag = hot.histogram(
            "kvgate_sync_lag_seconds",
            "Replica sync: from a peer publishing a batch to this gateway applying it",
            (),
            _SYNC_LAG_BUCKETS_S,
        )
        self.sync_events = hot.counter(
            "kvgate_sync_events",
            "Replica sync batches and items published/applied, and what was dropped or lost, by reason",
            ("event",),
        )
        self.queue_wait = hot.histogram(
            "kvgate_queue_wait_seconds",
            "Time requests waited in their pool's queue for a free worker slot (only requests that queued)",
            ("pool", "tenant"),
            _QUEUE_BUCKETS_S,
        )
        self.queue_refusals = hot.counter(
            "kvgate_queue_refusals",
            "Requests a pool's queue turned away, by reason (tenant_full, full, timeout)",
            ("pool", "tenant", "reason"),
        )
        r.register(hot)
        self.policy_events = SnapshotCounter(
            "kvgate_policy_events",
            "The routing policy's own counters (KV events applied, promotions, replications, ...)",
            ("policy", "event"),
        )
        r.register(self.policy_events)
        self.public_prefixes = Gauge(
            "kvgate_public_prefixes", "Prefixes promoted to the public namespace now", ["policy"], registry=r
        )
        self.breaker_state = Gauge(
            "kvgate_worker_breaker_state",
            "The worker's circuit breaker: 0 closed, 1 half-open (one trial request), 2 open",
            ["pool", "worker"],
            registry=r,
        )
        self.kv_events_lag = Gauge(
            "kvgate_kv_events_lag_seconds",
            "How late the worker's last KV-event batch arrived: receipt time minus the batch's "
            "timestamp (the worker's clock)",
            ["worker", "endpoint"],
            registry=r,
        )
        self.kv_events_age = Gauge(
            "kvgate_kv_events_last_batch_age_seconds",
            "Seconds since the worker's last KV-event batch arrived (grows while it is idle or stalled)",
            ["worker", "endpoint"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvgate_queue_depth",
            "Requests waiting in a pool's queue for a free worker slot",
            ["pool", "tenant"],
            registry=r,
        )
        # Called at scrape time, before rendering: gauges that are cheaper to read than to keep.
        self.before_scrape: list[Callable[[], None]] = []
        self.discovered_workers = Gauge(
            "kvgate_discovery_workers", "Workers a pool's discovery currently reports", ["pool"], registry=r
        )
        self.client_connections = Gauge(
            "kvgate_client_connections", "Open client connections of this process", registry=r
        )
        self.sync_peers = Gauge("kvgate_sync_peers", "Peer gateways heard from recently", registry=r)
        self.sync_connected = Gauge(
            "kvgate_sync_connected", "1 while connected to the sync broker", registry=r
        )
        self.sync_queued = Gauge("kvgate_sync_queued_items", "Sync items waiting to be published", registry=r)
        self.sync_unseen = Gauge(
            "kvgate_sync_unseen_peer_dispatches",
            "Peer dispatches one routing decision of this gateway could not see yet (decayed over 30 s,"
            " held while idle); at 0.5 or more the cost policy prefers its home share of the workers",
            registry=r,
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
        self.worker_healthy = Gauge(
            "kvgate_worker_healthy", "1 if the worker is routable", ["pool", "worker"], registry=r
        )

        # The children of one (model, tenant), fetched together. Label values come from the config
        # (and a small set of statuses), so every map of children stays bounded.
        self._per_model: dict[tuple[str, str], _ModelChildren] = {}

    def rejected(self, endpoint: str, status: int, tenant: str = "") -> None:
        """A request refused before it was tied to a served model: its tenant once its key was
        known (a configured name, so the labels stay bounded), the model label empty."""
        self.requests.labels("", tenant, str(status), endpoint).inc()

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

    def worker_outcome(self, pool: str, worker: str, outcome: Outcome) -> None:
        """One attempt on `worker` ended (`outcome.Attempt.end`)."""
        self.worker_requests.labels(pool, worker, outcome.value).inc()

    def time_per_output_token(self, model: str, seconds: float) -> None:
        self.tpot.labels(model).observe(seconds)

    def forget_workers(self, current: set[tuple[str, str]]) -> None:
        """Drop the per-worker series of every (pool, worker) not in `current`."""
        children = self.worker_requests.children
        for labels in [k for k in children if (k[0], k[1]) not in current]:
            del children[labels]

    def render(self) -> bytes:
        for refresh in self.before_scrape:
            refresh()
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


class SnapshotCounter(Collector):
    """A counter family whose totals are kept elsewhere (a policy's own counters) and copied in
    at scrape time with `set`; `clear` first, so a label tuple that is gone stops being exported."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = value

    def clear(self) -> None:
        self.values.clear()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        yield family


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
