"""The metrics that describe the present (workers, breakers, KV-event streams, the policy's
counters), read from the gateway's state when `/metrics` is scraped and never on a request's path."""

from __future__ import annotations

import time

from gateway.metrics import GatewayMetrics
from gateway.metrics.catalogue import BREAKER_STATE_VALUE
from gateway.state import GatewayState
from policies.stats import SupportsStats

# The one level among a policy's counters (the others only grow); exported as its own gauge.
_PUBLIC_PREFIXES = "public_prefixes"


def refresh_gauges(state: GatewayState) -> None:
    """Set every scrape-time series from the state; workers that discovery removed disappear."""
    now_s = time.monotonic()
    m = state.routing.metrics
    per_worker = (m.in_flight, m.worker_healthy, m.worker_waiting, m.worker_kv_usage, m.breaker_state)
    for gauge in (*per_worker, m.context_window):
        gauge.clear()
    _policy(state, m)
    if state.sync is not None:
        state.sync.refresh_metrics()
    current: set[tuple[str, str]] = set()
    for pool in state.registry.pools.values():
        for model, tokens in pool.windows.max_model_len.items():
            m.context_window.labels(pool.name, model).set(tokens)
        for worker in pool.workers.values():
            current.add((pool.name, worker.url))
            labels = (pool.name, worker.url)
            m.in_flight.labels(*labels).set(worker.in_flight)
            breaker = worker.breaker.state(now_s)
            m.breaker_state.labels(*labels).set(BREAKER_STATE_VALUE[breaker])
            m.worker_healthy.labels(*labels).set(1 if worker.healthy and worker.breaker.allows(now_s) else 0)
            view = worker.view(now_s, pool.metrics_max_age_s)
            if view.num_requests_waiting is not None:
                m.worker_waiting.labels(*labels).set(view.num_requests_waiting)
            if view.kv_usage is not None:
                m.worker_kv_usage.labels(*labels).set(view.kv_usage)
    m.forget_workers(current)
    _canaries(state, m, current)
    _kv_events(state, m, now_s)
    for tenant, limiter in state.gate.limiters.items():
        for quota, value in limiter.remaining(now_s).items():
            m.quota_remaining.labels(tenant, quota).set(value)
    m.answer_bytes_held.set(state.transport.answers.held_bytes)
    m.stream_bytes_buffered.set(state.transport.streams.held_bytes)


def _policy(state: GatewayState, m: GatewayMetrics) -> None:
    m.policy_events.clear()
    m.public_prefixes.clear()
    policy = state.routing.policy
    if not isinstance(policy, SupportsStats):
        return
    stats = policy.stats()
    for name, value in stats.counters.items():
        if name == _PUBLIC_PREFIXES:
            m.public_prefixes.labels(stats.policy).set(value)
        else:
            m.policy_events.set((stats.policy, name), value)


def _canaries(state: GatewayState, m: GatewayMetrics, current: set[tuple[str, str]]) -> None:
    m.canaries.clear()
    canaries = state.canaries
    if canaries is None:
        return
    canaries.forget_others(current)
    for (pool, worker, verdict), n in canaries.by_worker.items():
        m.canaries.set((pool, worker, verdict.value), n)


def _kv_events(state: GatewayState, m: GatewayMetrics, now_s: float) -> None:
    m.kv_events_lag.clear()
    m.kv_events_age.clear()
    subscriber = state.fleet.kv_events if state.fleet is not None else None
    if subscriber is None:
        return
    for worker in subscriber.workers():
        for endpoint, stats in subscriber.stream_stats(worker).items():
            if stats.last_batch_monotonic_s is not None:
                m.kv_events_age.labels(worker, endpoint).set(now_s - stats.last_batch_monotonic_s)
            if stats.last_batch_lag_s is not None:
                m.kv_events_lag.labels(worker, endpoint).set(stats.last_batch_lag_s)
