"""Tenants' quotas shared over the sync broker, each kind in turn: what one gateway charges to a
tenant's rpm and tpm is charged at its peers, and its requests in flight count against their
concurrency limit; the wire rows are bounded like every other field."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import msgpack
import pytest

from gateway.config import parse_config
from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.quotas import TenantLimiter, Usage
from gateway.state import build_state
from gateway.sync import codec
from gateway.sync.codec import MAX_BATCH_TENANTS, MalformedBatch, SyncBatch
from gateway.sync.service import SyncService
from gateway.sync.signing import BatchKey
from policies.cost_policy import CostPolicy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.gateway.sync.brokers import TestBroker, raw_publish
from tests.gateway.sync.signed import decode, doc_of, encode, sealed
from tests.support.gateway_config import tenant
from tests.support.wait import wait_until

W = [f"http://127.0.0.1:{9100 + i}" for i in range(2)]
QUOTAS = {"rpm": 10, "tpm": 10_000, "max_concurrent": 3}


def _service(url: str, origin: str) -> SyncService:
    config = parse_config(
        {
            "pools": [PoolConfig(name="p", models=["m"], workers=W).model_dump()],
            "tenants": [tenant("t", "sk-t", quotas=QUOTAS), tenant("free", "sk-free")],
            "sync": SyncConfig(url=url, batch_interval_s=0.001).model_dump(),
        }
    )
    state = build_state(config, b"secret", CostPolicy(seed=0), NormalizerConfig())
    service = SyncService(
        state.registry, state.routing, config.sync, origin, secret=state.secret, limiters=state.gate.limiters
    )
    state.sync = service
    return service


@contextlib.asynccontextmanager
async def _pair(broker: TestBroker) -> AsyncIterator[tuple[SyncService, SyncService]]:
    a, b = _service(broker.url, "a"), _service(broker.url, "b")
    await a.start()
    await b.start()
    try:
        await wait_until(lambda: a.link.connected and b.link.connected)
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def _t(service: SyncService) -> TenantLimiter:
    return service.limiters["t"]


async def test_a_tenants_requests_at_one_gateway_spend_its_quota_at_the_other(broker: TestBroker) -> None:
    async with _pair(broker) as (a, b):
        assert "free" not in a.limiters  # a tenant without quotas has nothing to share
        now = time.monotonic()
        for _ in range(3):
            assert _t(a).enter(now) is None
            assert _t(a).admit(1000, now) is None
        # Three in flight at a: b's limit of three is reached.
        await wait_until(lambda: _t(b).peers_in_flight == 3, what="a's requests in flight, at b")
        refused = _t(b).enter(time.monotonic())
        assert refused is not None and "concurrent" in refused.message
        for _ in range(3):
            _t(a).release(500, time.monotonic())
        await wait_until(lambda: _t(b).peers_in_flight == 0, what="a's requests ended, at b")
        # a spent 3 of the 10 requests and 4,500 of the 10,000 tokens: b has 7 and 5,500 left.
        now = time.monotonic()
        for _ in range(7):
            assert _t(b).enter(now) is None
            _t(b).leave()
        refused = _t(b).enter(now)
        assert refused is not None and "requests per minute" in refused.message
        await wait_until(lambda: _t(a).enter(time.monotonic()) is not None, what="b's requests, at a")
        assert a.subscriber.stats.unknown_tenant == 0


async def test_a_quota_row_forged_without_the_secret_spends_nothing(broker: TestBroker) -> None:
    # A holder of the broker's token without the key-hash secret makes up a's batches: the tenant's
    # whole quota spent and three requests in flight, numbered past a's own. b drops them unread;
    # a's real charges still reach it.
    async with _pair(broker) as (a, b):
        claim = SyncBatch("a", 2**40, time.time(), False, usage=(("t", Usage(10, 10_000, 3)),))
        bare = msgpack.packb({"v": 1, **msgpack.unpackb(codec.encode_body(claim))})  # as version 1 sent it
        await raw_publish(broker.url, b.link.subject, [bare, encode(claim, b"a made-up secret")])
        await wait_until(lambda: b.subscriber.stats.bad_signature == 2, what="the forgeries dropped at b")
        assert _t(b).remaining(time.monotonic())["requests"] > 9.9 and _t(b).peers_in_flight == 0
        assert _t(b).enter(time.monotonic()) is None
        _t(b).leave()
        assert _t(a).enter(time.monotonic()) is None  # a's own batches still apply at b
        await wait_until(lambda: _t(b).peers_in_flight == 1, what="a's request in flight, at b")
        assert b.subscriber.sequences.replayed == 0 and b.subscriber.stats.unknown_tenant == 0
        b.refresh_metrics()
        text = b.routing.metrics.render().decode()
        assert 'kvgate_sync_events_total{event="dropped_bad_signature"} 2.0' in text


async def test_a_silent_peers_requests_in_flight_stop_counting(broker: TestBroker) -> None:
    async with _pair(broker) as (a, b):
        assert _t(a).enter(time.monotonic()) is None
        await wait_until(lambda: _t(b).peers_in_flight == 1)
        await a.stop()  # a is gone without a word: its slot is b's again after the peer timeout
        b.subscriber.expire(time.monotonic() + b.config.peer_timeout_s + 1)
        assert _t(b).peers_in_flight == 0


async def test_a_gateway_that_stops_says_its_last_charges_and_that_nothing_is_in_flight(
    broker: TestBroker,
) -> None:
    async with _pair(broker) as (a, b):
        now = time.monotonic()
        assert _t(a).enter(now) is None
        await wait_until(lambda: _t(b).peers_in_flight == 1)
        for task in a._tasks[1:]:
            task.cancel()  # a's publishing stops here: only its last word can tell b
        _t(a).release(0, time.monotonic())
        assert _t(a).enter(time.monotonic()) is None
        _t(a).leave()
        await a.stop()
        await wait_until(lambda: _t(b).peers_in_flight == 0, what="a's last word at b", timeout_s=5)
        assert _t(b).remaining(time.monotonic())["requests"] < 8.1  # both of a's requests charged


def test_quota_rows_travel_and_are_read_back() -> None:
    usage = (("t", Usage(3, 20, 2)), ("u", Usage(0, 4500, 0)))
    batch = SyncBatch("a", 1, time.time(), False, usage=usage)
    assert decode(encode(batch)).usage == usage
    assert decode(encode(SyncBatch("a", 2, time.time(), False))).usage == ()


@pytest.mark.parametrize(
    "row",
    [
        ["t", 1, 2],  # a field short
        [7, 1, 2, 3],  # no tenant name
        ["t", -1, 0, 0],  # negative requests
        ["t", 0, 0, -1],  # negative in flight
        ["t", 0, 2**41, 0],  # more tokens than a gateway charges between two batches
        ["t", 0, -5, 0],  # tokens given back are never sent
        ["t", 0, 1.5, 0],  # tokens not an integer
        ["t", 2**33, 0, 0],
        ["t", True, 0, 0],
    ],
)
def test_a_malformed_quota_row_is_a_malformed_batch(row: list[object]) -> None:
    doc = doc_of(encode(SyncBatch("a", 1, time.time(), False)))
    doc["u"] = [row]
    with pytest.raises(MalformedBatch):
        decode(sealed(doc))


def test_more_quota_rows_than_a_gateway_sends_is_a_malformed_batch() -> None:
    doc = doc_of(encode(SyncBatch("a", 1, time.time(), False)))
    doc["u"] = [["t", 0, 0, 0]] * (MAX_BATCH_TENANTS + 1)
    with pytest.raises(MalformedBatch):
        decode(sealed(doc))


class _FlakyLink:
    """A link whose next publish fails while `up` is False, and records what it publishes."""

    connected = True
    max_payload = 1 << 20

    def __init__(self, key: BatchKey) -> None:
        self.key = key  # the service's, to read what it sealed
        self.up = False
        self.sent: list[SyncBatch] = []

    async def publish(self, data: bytes) -> bool:
        if self.up:
            self.sent.append(codec.decode(data, self.key))
        return self.up


async def test_quota_rows_of_a_batch_that_was_not_published_are_told_again() -> None:
    service = _service("nats://127.0.0.1:1", "a")  # never started: the fake link publishes
    link = _FlakyLink(service.key)
    service.link = link  # type: ignore[assignment]
    service.limiters["t"].notify = lambda: service._quota_changed("t")
    now = time.monotonic()
    assert _t(service).enter(now) is None  # one request charged, one in flight
    await service._send(now)  # the publish failed (a full buffer, a link that just dropped)
    link.up = True
    await service._send(now + 0.01)
    rows = [usage for batch in link.sent for tenant, usage in batch.usage if tenant == "t"]
    assert sum(u.requests for u in rows) == 1 and rows[-1].in_flight == 1, rows


async def test_a_tenant_name_peers_would_refuse_is_not_sent_and_spoils_nothing() -> None:
    service = _service("nats://127.0.0.1:1", "a")
    link = _FlakyLink(service.key)
    link.up = True
    service.link = link  # type: ignore[assignment]
    long_name = "t" * 2000
    service.publisher.share_usage([(long_name, Usage(1, 0, 1)), ("t", Usage(1, 0, 1))])
    await service._send(time.monotonic())
    assert [tenant for batch in link.sent for tenant, _ in batch.usage] == ["t"]
    assert service.publisher.oversized == 1
