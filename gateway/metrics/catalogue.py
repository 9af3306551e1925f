"""Every family the gateway exports: its name, labels, help text and buckets.

Families are registered in the order they are declared here, which is the order of the /metrics
page: the hot families first (one collector), then the policy's counters, then the gauges set at
scrape time (`gateway.gauges`, and the owners of queues, replica sync, discovery and the client
listener). Labels stay low-cardinality: model, tenant, status, policy, reason, pool, worker — never
request content.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, GCCollector, PlatformCollector, ProcessCollector

from gateway.breaker import BreakerState
from gateway.metrics.families import HotCollector, SnapshotCounter

_SYNC_LAG_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# A whole request may last up to `timeouts.total_s` (3600 s by default): its buckets reach that far.
_DURATION_BUCKETS_S = (*_LATENCY_BUCKETS_S, 300.0, 600.0, 1800.0, 3600.0)
# vLLM's buckets for its time-per-output-token histograms, so gateway and engine panels line up.
_TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_QUEUE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The value of `kvgate_worker_breaker_state` for each state, as its help text says.
BREAKER_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class MetricCatalogue:
    """The registry and every family in it, including the process's own (`process_*`, `python_*`).
    Owners write to the families directly (`metrics.queue_wait.labels(...)`); the few writes
    shared by several modules are `GatewayMetrics`' methods."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        # Counters and histograms kept as plain numbers (`families`), exported by one collector.
        hot = HotCollector()
        # Requests, their latencies and tokens, and where they went.
        self.requests = hot.counter(
            "kvgate_requests",
            "Finished requests, refused ones included: an empty model when refused before a served"
            " model was known, an empty tenant when the API key was missing, unknown (401) or sent"
            " twice (400 invalid_api_key)",
            ("model", "tenant", "status", "endpoint"),
        )
        self.ttft = hot.histogram(
            "kvgate_time_to_first_token_seconds",
            "Gateway-measured TTFT of streamed requests, from the dispatch to a worker to that"
            " worker's first event: time in the pool's queue is not in it",
            ("model",),
            _LATENCY_BUCKETS_S,
        )
        self.duration = hot.histogram(
            "kvgate_request_duration_seconds",
            "Time from request to last byte (queue wait and retries included)",
            ("model",),
            _DURATION_BUCKETS_S,
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
            "kvgate_completion_tokens",
            "Completion tokens charged: the worker's count, or the content events relayed when a"
            " stream ended before its usage and they are more",
            ("model", "tenant"),
        )
        # Discovery.
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
        self.worker_restarts = hot.counter(
            "kvgate_worker_restarts",
            "Workers seen restarted in place by their metrics (a new process start time, or a"
            " counter gone down): the policy forgets what they held",
            ("pool",),
        )
        # Prefill/decode pools.
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
        # Client connection limits.
        self.client_refusals = hot.counter(
            "kvgate_client_refusals",
            "Client connections closed by a limit, by reason: before their request reached the gateway"
            " (header_too_large, too_many_headers, header_timeout, body_timeout, connection_limit,"
            " address_limit, invalid_http, upgrade_with_body: a request asking to upgrade its"
            " connection with a body; missing_host, duplicate_host, invalid_host,"
            " invalid_transfer_encoding, unsupported_transfer_encoding: the framing of its head),"
            " after answering 16 pipelined requests (pipelined_requests),"
            " while an answer waited on a client that read nothing (send_timeout),"
            " or to give their place to a new connection in a full table, holding it without a"
            " request in the app (evicted)",
            ("reason",),
        )
        # Replica sync.
        self.sync_lag = hot.histogram(
            "kvgate_sync_lag_seconds",
            "Replica sync: from a peer publishing a batch to this gateway applying it",
            (),
            _SYNC_LAG_BUCKETS_S,
        )
        self.sync_events = hot.counter(
            "kvgate_sync_events",
            "Replica sync batches and items published, applied or parked, and what was dropped or lost",
            ("event",),
        )
        # Pool queues.
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
        # Whole answers held in memory until written to their clients (`gateway.answer_budget`).
        self.answer_budget_refusals = hot.counter(
            "kvgate_answer_budget_refusals",
            "Whole worker answers cut off because the bytes of answers held would pass "
            "limits.max_buffered_answer_bytes (the client got 503 gateway_overloaded)",
            (),
        )
        self.answer_share_refusals = hot.counter(
            "kvgate_answer_share_refusals",
            "Whole worker answers cut off because the tenant's answers held would pass its "
            "share of limits.max_buffered_answer_bytes (the client got 503 gateway_overloaded)",
            ("tenant",),
        )
        # The policy file (`gateway.policy_watch`).
        self.policy_reloads = hot.counter(
            "kvgate_policy_reloads",
            "Reloads of the policy file (a changed version the watcher read, an admin call, SIGHUP) by"
            " result: applied (a new policy runs), rejected (the file could not be read, parsed or"
            " built: the running policy stays), unchanged (its content is the running policy's)",
            ("result",),
        )
        # The admin API (`gateway.admin_throttle`).
        self.admin_auth_failures = hot.counter(
            "kvgate_admin_auth_failures",
            "Admin requests refused for their key, by result: wrong_key (a key was checked and is not"
            " the admin key; 401), throttled (the client address sent too many wrong keys in its"
            " window: 429 without checking the key)",
            ("result",),
        )
        r.register(hot)
        # Copied or set at scrape time.
        self.policy_events = SnapshotCounter(
            "kvgate_policy_events",
            "The routing policy's own counters (KV events applied, promotions, replications, ...)",
            ("policy", "event"),
        )
        r.register(self.policy_events)
        self.policy_reload_failing = Gauge(
            "kvgate_policy_reload_failing",
            "1 while the last reload of the policy file was rejected: the running policy is not the"
            " file's (0 once a reload applies it or finds it unchanged)",
            registry=r,
        )
        self.public_prefixes = Gauge(
            "kvgate_public_prefixes", "Prefixes promoted to the public namespace now", ["policy"], registry=r
        )
        self.breaker_state = Gauge(
            "kvgate_worker_breaker_state",
            "The worker's circuit breaker: 0 closed, 1 half-open (one trial request), 2 open",
            ["pool", "worker"],
            registry=r,
        )
        self.canaries = SnapshotCounter(
            "kvgate_breaker_canaries",
            "The gateway's own one-token requests to a worker whose failures no other worker"
            " compared, by verdict: failed (counted on its breaker), passed (suspicion cleared),"
            " inconclusive (a busy 503 or 529, a 4xx, a timeout: nothing decided)",
            ("pool", "worker", "verdict"),
        )
        r.register(self.canaries)
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
        self.quota_remaining = Gauge(
            "kvgate_tenant_quota_remaining",
            "What is left of a tenant's quota now: requests (rpm), tokens (tpm), concurrent requests",
            ["tenant", "quota"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvgate_queue_depth",
            "Requests waiting in a pool's queue for a free worker slot",
            ["pool", "tenant"],
            registry=r,
        )
        self.discovered_workers = Gauge(
            "kvgate_discovery_workers", "Workers a pool's discovery currently reports", ["pool"], registry=r
        )
        self.answer_bytes_held = Gauge(
            "kvgate_answer_bytes_held",
            "Bytes of whole worker answers held now (read, or being read, and not yet written to "
            "their clients), across requests (at most limits.max_buffered_answer_bytes)",
            registry=r,
        )
        self.stream_bytes_buffered = Gauge(
            "kvgate_stream_bytes_buffered",
            "Bytes of streamed worker answers received and not yet taken by their relays, across "
            "requests (past limits.max_buffered_stream_bytes each stream stops reading sooner)",
            registry=r,
        )
        self.client_connections = Gauge(
            "kvgate_client_connections", "Open client connections of this process", registry=r
        )
        self.processes_held = Gauge(
            "kvgate_processes_held",
            "kvgate serve --processes N, process 0: the other processes the supervisor holds down"
            " after crash-looping past their restart budget (/readyz does not wait for them)",
            registry=r,
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
        self.context_window = Gauge(
            "kvgate_model_context_window_tokens",
            "A model's context window in tokens, stated by its pool's max_model_len or the smallest its"
            " live workers report on /v1/models; no series while unknown",
            ["pool", "model"],
            registry=r,
        )
