"""Two deployments on one subject: a gateway counts, and applies, only the gateways with a pool in
common with it (`gateway.sync.deployment`), whatever their pools are called."""

from __future__ import annotations

import time

import pytest

from gateway.config import parse_config
from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.state import GatewayState, build_state
from gateway.sync.broker import LocalBroker
from gateway.sync.codec import MAX_BATCH_POOLS, MalformedBatch, SyncBatch
from gateway.sync.deployment import pool_fingerprint
from gateway.sync.publisher import SyncPublisher
from gateway.sync.service import SyncService
from gateway.sync.subscriber import SyncSubscriber
from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerCalibration, PeerHolding, PeerItem, PeerLoad
from prompt_normalizer.normalizer import NormalizerConfig
from tests.e2e.harness import tenant
from tests.gateway.sync.signed import SECRET, decode, doc_of, encode, sealed
from tests.policies.factories import BS, req
from tests.support.wait import wait_until

OURS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
THEIRS = [f"http://10.9.0.{i}:8000" for i in range(1, 5)]
P = pool_fingerprint("p", ["m"], SECRET)  # this gateway's one pool


def _subscriber() -> tuple[SyncSubscriber, Registry, CostPolicy]:
    registry = Registry([PoolConfig(name="p", models=["m"], workers=OURS)])
    for worker in registry.pools["p"].workers.values():
        worker.healthy = True
    policy = CostPolicy(seed=0, herd_weight=2.0)
    policy.set_sync_sink(lambda item, now_s: None, origin="me")
    return (
        SyncSubscriber("me", registry, 5.0, GatewayMetrics(), secret=SECRET, share_calibration=True),
        registry,
        policy,
    )


def _batch(origin: str, seq: int, pools: tuple[int, ...] | None, pool: str = "p", ref: int = 1) -> bytes:
    """What a gateway with `pools` publishes after routing a request in `pool` to OURS[1]: its
    holding, its calibration sample and its load there (a worker of the same address as ours)."""
    r = req(f"{origin}-{ref}", range(1000 * ref, 1000 * ref + 64), pool=pool)
    items: tuple[PeerItem, ...] = (
        PeerHolding(ref, pool, BS, "t", r.block_keys, WorkerId(OURS[1]), r.n_prompt_tokens, 0),
        PeerCalibration(pool, BS, 4000, 1000, 50.0),
    )
    loads = (PeerLoad(pool, WorkerId(OURS[1]), 2, 500, 8),)
    return encode(SyncBatch(origin, seq, time.time(), True, items, loads, pools=pools))


async def test_gateways_of_another_deployment_on_the_subject_are_neither_counted_nor_applied() -> None:
    sub, registry, policy = _subscriber()
    # The other deployment: a gateway whose pool of the same name serves another model, and one
    # with pools of other names. Both name a worker at the same address as one of ours.
    # And one whose pool has this one's name and models but whose keys are keyed by another secret
    # (none of its holdings could match here).
    other = {
        "x1": (pool_fingerprint("p", ["m2"], SECRET),),
        "x2": (pool_fingerprint("q", ["m"], SECRET), pool_fingerprint("r", ["m"], SECRET)),
        "x3": (pool_fingerprint("p", ["m"], b"another deployment's secret"),),
    }
    for seq in (1, 2):
        for origin, pools in other.items():
            await sub.on_message(_batch(origin, seq, pools, ref=seq), lambda: policy)
    now = time.monotonic()
    assert policy._gateways.names(now) == ("me",) and sub.loads.peers() == 0
    assert sub.stats.other_deployment == 6 and sub.stats.batches == 0 and len(sub.parked) == 0
    # A gateway of this deployment (with a pool more than this one).
    await sub.on_message(_batch("peer", 1, (P, pool_fingerprint("z", ["m"], SECRET)), ref=9), lambda: policy)
    assert policy._gateways.names(now) == ("me", "peer")  # the deal of home shares: two gateways
    assert sub.loads.peers() == 1 and sub.stats.batches == 1
    # Only the peer weighs on the worker, in the index and in the calibration.
    assert registry.pools["p"].workers[WorkerId(OURS[1])].view(now).in_flight_requests == 2
    counters = policy.stats().counters
    assert counters["peer_holdings_applied"] == 1 and counters["peer_calibration_applied"] == 1
    views = registry.pools["p"].views(now)
    for ref, hit in ((1, False), (2, False), (9, True)):
        d = policy.select(req("next", range(1000 * ref, 1000 * ref + 66), pool="p"), views, now)
        assert d is not None and (d.reason == "hit") is hit


async def test_a_gateway_that_says_it_has_none_of_these_pools_is_forgotten_with_its_load() -> None:
    sub, registry, policy = _subscriber()
    w1 = registry.pools["p"].workers[WorkerId(OURS[1])]
    await sub.on_message(_batch("peer", 1, (P,)), lambda: policy)
    assert sub.loads.peers() == 1 and w1.view(time.monotonic()).in_flight_requests == 2
    # The same name now publishes for another deployment: not a peer, its load gone at once.
    await sub.on_message(_batch("peer", 2, (pool_fingerprint("p", ["m2"], SECRET),), ref=2), lambda: policy)
    assert sub.loads.peers() == 0 and w1.view(time.monotonic()).in_flight_requests == 0
    assert sub.stats.other_deployment == 1


async def test_of_a_peers_batch_only_the_pools_both_have_apply() -> None:
    registry = Registry(
        [
            PoolConfig(name="p", models=["m"], workers=OURS[:2]),
            PoolConfig(name="q", models=["m-here"], workers=OURS[2:]),
        ]
    )
    sub = SyncSubscriber("me", registry, 5.0, GatewayMetrics(), secret=SECRET, share_calibration=True)
    policy = CostPolicy(seed=0)
    theirs = (P, pool_fingerprint("q", ["m-there"], SECRET))  # its "q" serves another model: another pool
    r = req("r", range(64), pool="q")
    items = (PeerHolding(1, "q", BS, "t", r.block_keys, WorkerId(OURS[2]), r.n_prompt_tokens, 0),)
    loads = (PeerLoad("p", WorkerId(OURS[0]), 1, 10, 1), PeerLoad("q", WorkerId(OURS[2]), 3, 10, 1))
    await sub.on_message(
        encode(SyncBatch("peer", 1, time.time(), True, items, loads, pools=theirs)), lambda: policy
    )
    assert sub.loads.peers() == 1 and sub.stats.unknown_worker == 2
    assert (
        sub.loads.total("p", WorkerId(OURS[0])) == loads[0]
        and sub.loads.total("q", WorkerId(OURS[2])) is None
    )
    assert "peer_holdings_applied" not in policy.stats().counters
    # A gateway of an earlier release does not say which pools it has: all of them are taken as shared.
    await sub.on_message(encode(SyncBatch("old", 1, time.time(), True, items, loads)), lambda: policy)
    assert sub.loads.peers() == 2 and policy.stats().counters["peer_holdings_applied"] == 1


def test_a_batch_carries_its_senders_pools_and_a_reader_bounds_them() -> None:
    pub = SyncPublisher("me", SyncConfig(), (P, 2**64 - 1))
    batch = pub.next_batch([], 0.0)
    assert batch is not None and decode(encode(batch)).pools == (P, 2**64 - 1)
    assert (
        pool_fingerprint("p", ["b", "a", "a"], SECRET)
        == pool_fingerprint("p", ["a", "b"], SECRET)
        != pool_fingerprint("q", ["a", "b"], SECRET)
    )
    for bad in ([-1], ["p"], list(range(MAX_BATCH_POOLS + 1))):
        doc = doc_of(encode(batch))
        doc["d"] = bad
        with pytest.raises(MalformedBatch):
            decode(sealed(doc))


def _state(url: str, workers: list[str], model: str, secret: bytes = b"secret") -> GatewayState:
    config = parse_config(
        {
            "pools": [PoolConfig(name="p", models=[model], workers=workers).model_dump()],
            "tenants": [tenant("t", "sk-t")],
            # The default subject for both deployments; whole snapshots five times a second.
            "sync": SyncConfig(
                url=url, batch_interval_s=0.001, load_refresh_s=0.2, peer_timeout_s=1.0
            ).model_dump(),
        }
    )
    return build_state(config, secret, CostPolicy(seed=0, herd_weight=2.0), NormalizerConfig())


@pytest.mark.parametrize("apart_by", ["models", "secret"])
async def test_two_deployments_on_one_broker_subject_each_count_their_own_gateways(
    broker: LocalBroker, apart_by: str
) -> None:
    # Two deployments on the default subject, told apart by their pools' models, or only by their
    # key-hash secrets (same pool name, same model).
    names = {"a1": OURS, "a2": OURS, "b1": THEIRS, "b2": THEIRS}

    def state(name: str) -> GatewayState:
        ours = name[0] == "a"
        if apart_by == "models":
            return _state(broker.url, names[name], "m" if ours else "m2")
        return _state(broker.url, names[name], "m", b"secret" if ours else b"their secret")

    states = {name: state(name) for name in names}
    services = {
        n: SyncService(s.registry, s.routing, s.config.sync, n, secret=s.secret) for n, s in states.items()
    }
    for name, service in services.items():
        states[name].sync = service
        await service.start()
    try:
        subs = [s.subscriber for s in services.values()]
        # Each has heard its own peer, and at least two load snapshots of each of the others.
        # Another secret's batches do not verify under this deployment's key: they are dropped
        # unread (`signing`), before their pools are looked at.
        apart = "bad_signature" if apart_by == "secret" else "other_deployment"
        await wait_until(
            lambda: all(sub.loads.peers() == 1 and getattr(sub.stats, apart) >= 4 for sub in subs)
        )
        now = time.monotonic()
        for name, service in services.items():
            policy = service.routing.policy
            assert isinstance(policy, CostPolicy)
            own = tuple(sorted(n for n in names if n[0] == name[0]))
            assert policy._gateways.names(now) == own
            service.refresh_metrics()
            text = service.routing.metrics.render().decode()
            assert "kvgate_sync_peers 1.0" in text
            assert f'kvgate_sync_events_total{{event="dropped_{apart}"}}' in text
    finally:
        for service in services.values():
            await service.stop()
