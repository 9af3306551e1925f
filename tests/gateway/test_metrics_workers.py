"""Scrape-time metrics: per-worker outcomes (dropped with the worker), breaker states, the
policy's counters typed as counters, KV-event lag, process metrics, time per output token."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.gauges import refresh_gauges
from gateway.kv_event_types import KvEventEndpoint, SubscriptionStats
from gateway.kv_events import KvEventSubscriber
from gateway.metrics import GatewayMetrics
from gateway.state import GatewayState, build_state
from policies.base import Outcome, WorkerId
from policies.config import PolicyConfig, build_policy
from policies.stats import PolicyStats
from prompt_normalizer.normalizer import NormalizerConfig
from tests.gateway.kv_event_payloads import stored_array
from tests.support.policies import IgnoresFeedback

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def _families(m: GatewayMetrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def _samples(m: GatewayMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
        if s.name == name
    }


def _state(policy: Any = None) -> GatewayState:
    config = parse_config(
        {
            "pools": [{"name": "p", "models": ["m"], "workers": [A, B], "breaker": {"failure_threshold": 1}}],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}],
        }
    )
    return build_state(config, b"k", policy or build_policy(PolicyConfig()), NormalizerConfig())


def test_outcomes_per_worker_go_when_the_worker_leaves_its_pool() -> None:
    state = _state()
    m = state.routing.metrics
    m.worker_outcome("p", A, Outcome.SERVED)
    m.worker_outcome("p", A, Outcome.SERVED)
    m.worker_outcome("p", B, Outcome.WORKER_FAILED)
    refresh_gauges(state)
    outcomes = _samples(m, "kvgate_worker_requests_total")
    assert outcomes[(("outcome", "served"), ("pool", "p"), ("worker", A))] == 2
    assert outcomes[(("outcome", "worker_failed"), ("pool", "p"), ("worker", B))] == 1
    assert _families(m)["kvgate_worker_requests"].type == "counter"

    state.registry.pools["p"].set_urls([A])  # discovery dropped B
    refresh_gauges(state)
    assert {dict(k)["worker"] for k in _samples(m, "kvgate_worker_requests_total")} == {A}
    assert {dict(k)["worker"] for k in _samples(m, "kvgate_worker_breaker_state")} == {A}


def test_breaker_state_is_its_own_gauge() -> None:
    state = _state()
    pool = state.registry.pools["p"]
    now_s = time.monotonic()
    pool.workers[WorkerId(B)].breaker.on_failure(now_s, trial=None)  # threshold 1: open
    refresh_gauges(state)
    states = _samples(state.routing.metrics, "kvgate_worker_breaker_state")
    assert states[(("pool", "p"), ("worker", A))] == 0
    assert states[(("pool", "p"), ("worker", B))] == 2
    pool.workers[WorkerId(B)].breaker._opened_at_s = now_s - 3600  # cooled down: one trial allowed
    refresh_gauges(state)
    assert _samples(state.routing.metrics, "kvgate_worker_breaker_state")[(("pool", "p"), ("worker", B))] == 1


@dataclass
class CountingPolicy(IgnoresFeedback):
    """A policy that reports fixed counters; `public_prefixes` is a level that can go down."""

    counters: dict[str, int] = field(default_factory=dict)
    name: str = "counting"

    def stats(self) -> PolicyStats:
        return PolicyStats(policy=self.name, decisions_by_reason={}, counters=dict(self.counters))

    def select(self, *_: Any) -> None:
        return None


def test_policy_counters_are_counters_and_the_promoted_count_a_gauge() -> None:
    policy = CountingPolicy({"kv_events_applied": 7, "public_promotions": 2, "public_prefixes": 2})
    state = _state(policy)
    refresh_gauges(state)
    families = _families(state.routing.metrics)
    assert families["kvgate_policy_events"].type == "counter"
    events = _samples(state.routing.metrics, "kvgate_policy_events_total")
    assert events == {
        (("event", "kv_events_applied"), ("policy", "counting")): 7,
        (("event", "public_promotions"), ("policy", "counting")): 2,
    }
    assert _samples(state.routing.metrics, "kvgate_public_prefixes") == {(("policy", "counting"),): 2}
    policy.counters["public_prefixes"] = 1  # a demotion: the gauge follows it down
    refresh_gauges(state)
    assert _samples(state.routing.metrics, "kvgate_public_prefixes") == {(("policy", "counting"),): 1}


def test_process_metrics_are_exported() -> None:
    names = set(_families(GatewayMetrics()))
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "python_info"} <= names


def test_time_per_output_token_uses_vllms_buckets() -> None:
    m = GatewayMetrics()
    for seconds in (0.01, 0.02, 100.0):
        m.time_per_output_token("m", seconds)
    buckets = {
        dict(k)["le"]: v
        for k, v in _samples(m, "kvgate_request_time_per_output_token_seconds_bucket").items()
    }
    assert buckets["0.01"] == 1 and buckets["0.025"] == 2 and buckets["80.0"] == 2 and buckets["+Inf"] == 3


@dataclass
class StubSubscriber:
    streams: dict[str, dict[str, SubscriptionStats]]

    def workers(self) -> list[str]:
        return list(self.streams)

    def stream_stats(self, worker: str) -> dict[str, SubscriptionStats]:
        return self.streams[worker]


@dataclass
class StubFleet:
    kv_events: StubSubscriber


def test_kv_event_lag_and_age_per_stream() -> None:
    state = _state()
    now_s = time.monotonic()
    fresh = SubscriptionStats(last_batch_monotonic_s=now_s - 2.0, last_batch_lag_s=0.25)
    never = SubscriptionStats()
    state.fleet = StubFleet(StubSubscriber({A: {"tcp://10.0.0.1:5557": fresh, "tcp://10.0.0.1:5558": never}}))  # type: ignore[assignment]
    refresh_gauges(state)
    labels = (("endpoint", "tcp://10.0.0.1:5557"), ("worker", A))
    assert _samples(state.routing.metrics, "kvgate_kv_events_lag_seconds") == {labels: 0.25}
    (age,) = _samples(state.routing.metrics, "kvgate_kv_events_last_batch_age_seconds").values()
    assert age >= 2.0


async def test_the_subscriber_records_how_late_a_batch_arrived() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    received = asyncio.Event()
    sub = KvEventSubscriber(lambda *_: received.set())
    worker = WorkerId("w")
    try:
        await sub.start([KvEventEndpoint(worker, f"tcp://127.0.0.1:{port}")])
        async with asyncio.timeout(5):
            assert (await pub.recv())[:1] == b"\x01"  # the subscriber joined
        payload = msgpack.packb([time.time() - 30.0, [stored_array([1], None)], None])
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
        async with asyncio.timeout(5):
            await received.wait()
        stats = sub.stats(worker)
        assert stats is not None and stats.last_batch_lag_s is not None
        assert stats.last_batch_lag_s >= 30.0  # at least how old the batch was when sent
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.destroy(linger=0)
