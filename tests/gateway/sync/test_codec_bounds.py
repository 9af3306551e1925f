"""What one hostile batch can make a receiver build: never much more than the batch itself.

A msgpack message of 1 MiB (NATS's default `max_payload`; the chart's broker takes 8 MiB) can
describe a million empty arrays, each a Python list of about 72 bytes: decoded whole, before any
check of its shape, such a batch cost 75 MB and a second of the event loop (600 MB and 4 s at
8 MiB). The decoder builds only what the wire format has room for.
"""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import pytest
from pydantic import ValidationError

from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync.codec import (
    MAX_BATCH_ITEMS,
    MAX_BATCH_LOADS,
    MAX_NAME_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_WAIT_S,
    PUBLISH_BATCH_ITEMS,
    MalformedBatch,
    SyncBatch,
)
from gateway.sync.publisher import SyncPublisher
from gateway.sync.signing import ENVELOPE_BYTES, TAG_BYTES, BadSignature, BatchKey
from gateway.sync.subscriber import SyncSubscriber
from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerCalibration, PeerHolding, PeerLoad, PeerOutcome
from prompt_normalizer.types import BlockKey
from tests.gateway.sync.signed import SECRET, decode, doc_of, encode, sealed

_MIB = 1 << 20


def _array(n: int, each: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + each * n


def _batch(field: bytes, value: bytes) -> bytes:
    """A good batch (`_GOOD`) with `field` set to the raw msgpack `value`, `field` written last,
    sealed: what only a holder of the key-hash secret can send."""
    doc = doc_of(_GOOD)
    doc.pop(field.decode(), None)
    head = msgpack.packb(doc, use_bin_type=True)
    n = len(doc) + 1
    assert head[0] == 0x80 | len(doc) and n < 16
    return sealed(bytes([0x80 | n]) + head[1:] + msgpack.packb(field.decode()) + value)


_GOOD = encode(
    SyncBatch(
        "gw-a", 1, 0.0, True,
        (PeerHolding(1, "p", 16, "tenant:a", (BlockKey(7),), WorkerId("w0"), 16, 0), PeerOutcome(1, True)),
        (PeerLoad("p", WorkerId("w0"), 1, 16, 0),),
    )
)  # fmt: skip


def _nested(depth: int, width_bytes: int) -> bytes:
    """Arrays nested `depth` deep, each holding `width_bytes` empty arrays before the next level."""
    level = b"\xdd" + (width_bytes + 1).to_bytes(4, "big") + b"\x90" * width_bytes
    return level * depth + b"\x90" * 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (b"i", _array(_MIB, b"\x90")),  # a million empty items
        (b"l", _array(_MIB // 2, b"\x91\x90")),  # load rows of one empty array each
        (b"p", _array(_MIB // 3, b"\xa2ab")),  # a string table of 350,000 two-letter names
        (b"x", _array(_MIB, b"\x80")),  # a million empty maps
        (b"z", _array(_MIB, b"\x90")),  # a field of a later release, as large
        (b"z", _nested(200, 5300)),  # deep, with room at every level
    ],
)
def test_a_hostile_batch_builds_little_before_it_is_refused_or_skipped(field: bytes, value: bytes) -> None:
    data = _batch(field, value)
    assert _MIB <= len(data) <= 2 * _MIB
    tracemalloc.start()
    try:
        try:
            batch = decode(data, now_wall_s=0.0)
        except MalformedBatch:
            assert field != b"z"
        else:
            assert field == b"z" and batch == decode(_GOOD, now_wall_s=0.0)  # a later release's field
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The unpacker's copy of the batch, grown as it is fed (whole, the batch cost 75 MiB here).
    assert peak < 4 * len(data), f"{peak / _MIB:.0f} MiB for a {len(data) / _MIB:.1f} MiB batch"


def test_the_hostile_shapes_differ_from_a_good_batch_only_in_their_field() -> None:
    assert decode(_batch(b"z", msgpack.packb([1, [2, 3]])), now_wall_s=0.0) == decode(_GOOD, now_wall_s=0.0)
    assert decode(_batch(b"l", msgpack.packb([])), now_wall_s=0.0).loads == ()


def test_a_batch_of_more_items_than_any_gateway_publishes_is_malformed() -> None:
    outcomes = tuple(PeerOutcome(ref, True) for ref in range(MAX_BATCH_ITEMS + 1))
    assert len(decode(encode(SyncBatch("gw-a", 1, 0.0, False, outcomes[:-1])), now_wall_s=0.0).items) == (
        MAX_BATCH_ITEMS
    )
    with pytest.raises(MalformedBatch):
        decode(encode(SyncBatch("gw-a", 1, 0.0, False, outcomes)), now_wall_s=0.0)


def test_a_batch_of_more_loads_than_any_fleet_has_is_malformed() -> None:
    loads = tuple(PeerLoad("p", WorkerId(f"w{i}"), 1, 0, 1) for i in range(MAX_BATCH_LOADS + 1))
    assert len(decode(encode(SyncBatch("gw-a", 1, 0.0, True, (), loads[:-1])), now_wall_s=0.0).loads) == (
        MAX_BATCH_LOADS
    )
    with pytest.raises(MalformedBatch):
        decode(encode(SyncBatch("gw-a", 1, 0.0, True, (), loads)), now_wall_s=0.0)


def test_a_publisher_never_puts_more_items_in_a_batch_than_peers_accept() -> None:
    with pytest.raises(ValidationError, match="batch_max_items"):
        SyncConfig(batch_max_items=PUBLISH_BATCH_ITEMS + 1)
    pub = SyncPublisher("me", SyncConfig(batch_max_items=PUBLISH_BATCH_ITEMS))
    for ref in range(PUBLISH_BATCH_ITEMS + 10):
        pub.sink(PeerOutcome(ref, True), 0.0)
    first, second = pub.next_batch([], 0.0), pub.next_batch([], 0.0)
    assert first is not None and second is not None
    assert [len(b.items) for b in (first, second)] == [PUBLISH_BATCH_ITEMS, 10]
    assert PUBLISH_BATCH_ITEMS < MAX_BATCH_ITEMS and len(decode(encode(first)).items) == PUBLISH_BATCH_ITEMS


def _named(field: str, name: str) -> bytes:
    def pick(what: str, default: str) -> str:
        return name if field == what else default

    holding = PeerHolding(
        1, pick("pool", "p"), 16, pick("namespace", "t"), (BlockKey(1),), WorkerId(pick("worker", "w")), 16, 0
    )
    load = PeerLoad(pick("pool", "p"), WorkerId(pick("worker", "w")), 1, 16, 0)
    return encode(SyncBatch(pick("origin", "o"), 1, 0.0, False, (holding,), (load,)))


@pytest.mark.parametrize("field", ["origin", "pool", "namespace", "worker"])
def test_a_name_longer_than_any_gateway_sends_is_malformed(field: str) -> None:
    # A receiver keeps these names (an origin with its load, a namespace with each index entry of
    # its holdings): their length is what a made-up one costs it.
    assert decode(_named(field, "n" * MAX_NAME_BYTES), now_wall_s=0.0).items
    assert decode(_named(field, "é" * (MAX_NAME_BYTES // 2)), now_wall_s=0.0).items  # bytes, not characters
    for name in ("n" * (MAX_NAME_BYTES + 1), "é" * (MAX_NAME_BYTES // 2 + 1), "n" * (1 << 20)):
        with pytest.raises(MalformedBatch):
            decode(_named(field, name), now_wall_s=0.0)


async def test_senders_with_long_names_leave_nothing_behind() -> None:
    w0 = "http://127.0.0.1:9001"
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[w0])])
    sub = SyncSubscriber("me", registry, 5.0, GatewayMetrics(), secret=SECRET)
    policy = CostPolicy(seed=0)
    for i in range(20):
        load = PeerLoad("p", WorkerId(w0), 1, 16, 0)
        origin = f"{i}:" + "x" * (100 << 10)  # 100 KiB a name, kept with its load for 5 s
        await sub.on_message(encode(SyncBatch(origin, 1, time.time(), True, (), (load,))), lambda: policy)
    assert sub.stats.malformed == 20 and sub.loads.peers() == 0 and sub.stats.batches == 0


def test_a_publisher_drops_what_peers_would_refuse_and_counts_it() -> None:
    pub = SyncPublisher("me", SyncConfig())
    long_name = "tenant:" + "x" * MAX_NAME_BYTES
    pub.sink(PeerHolding(1, "p", 16, long_name, (BlockKey(1),), WorkerId("w"), 16, 0), 0.0)
    pub.sink(PeerOutcome(1, True), 0.0)
    long_load = PeerLoad("p", WorkerId("http://" + "w" * MAX_NAME_BYTES), 1, 16, 0)
    batch = pub.next_batch([long_load, PeerLoad("p", WorkerId("w"), 1, 16, 0)], 0.0)
    assert batch is not None and batch.items == (PeerOutcome(1, True),) and pub.oversized == 1
    assert [x.worker for x in batch.loads] == ["w"]
    assert decode(encode(batch)) == batch


def _tokens(prompt: int, matched: int = 0, sample_prompt: int = 100, sample_request: int = 25) -> bytes:
    holding = PeerHolding(1, "p", 16, "t", (BlockKey(1),), WorkerId("w"), prompt, matched)
    sample = PeerCalibration("p", 16, sample_prompt, sample_request, 1.0)
    return encode(SyncBatch("o", 1, 0.0, False, (holding, sample)))


def test_a_prompt_longer_than_any_request_is_malformed() -> None:
    # A peer's holding charges its prompt's prefill to the worker for minutes (`cost`'s recent
    # work, 180 s time constant) and into the mean work per dispatch that weighs the herd term: a
    # made-up prompt of 2**64 tokens was 2e29 s of work, the worker shunned for three hours.
    assert decode(
        _tokens(MAX_PROMPT_TOKENS, MAX_PROMPT_TOKENS, MAX_PROMPT_TOKENS, MAX_PROMPT_TOKENS), now_wall_s=0.0
    )
    for data in (
        _tokens(MAX_PROMPT_TOKENS + 1),
        _tokens(16, MAX_PROMPT_TOKENS + 1),
        _tokens(2**64 - 1),
        _tokens(16, sample_prompt=MAX_PROMPT_TOKENS + 1),
        _tokens(16, sample_request=2**64 - 1),
    ):
        with pytest.raises(MalformedBatch):
            decode(data, now_wall_s=0.0)


def test_a_publisher_drops_a_prompt_peers_would_refuse_and_counts_it() -> None:
    pub = SyncPublisher("me", SyncConfig())
    pub.sink(PeerHolding(1, "p", 16, "t", (BlockKey(1),), WorkerId("w"), MAX_PROMPT_TOKENS + 1, 0), 0.0)
    pub.sink(PeerCalibration("p", 16, MAX_PROMPT_TOKENS + 1, 100, 1.0), 0.0)
    pub.sink(PeerOutcome(1, True), 0.0)
    batch = pub.next_batch([], 0.0)
    assert batch is not None and batch.items == (PeerOutcome(1, True),) and pub.oversized == 2


def test_items_queued_through_a_long_broker_outage_still_reach_the_peers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The broker was down for more than an hour: the first batch after it carries items that
    # waited longer than a batch may say (peers refused it whole, its loads with it).
    clock = [100.0]
    monkeypatch.setattr("gateway.sync.publisher.time.monotonic", lambda: clock[0])
    pub = SyncPublisher("me", SyncConfig())
    pub.sink(PeerOutcome(1, True), 0.0)
    clock[0] += 2 * MAX_WAIT_S
    batch = pub.next_batch([PeerLoad("p", WorkerId("w"), 1, 16, 0)], 0.0)
    assert batch is not None and batch.waited_s == MAX_WAIT_S
    assert decode(encode(batch)) == batch


@pytest.mark.parametrize("shape", ["bare", "under another key", "sealed, too large"])
def test_a_batch_not_sealed_under_the_key_is_refused_before_anything_of_it_is_built(shape: str) -> None:
    # Without the key-hash secret, 8 MiB of empty arrays (built, 600 MB) is read no further than its
    # header and tag; a batch above 8 MiB is refused for its size before even the tag is made.
    body = _batch(b"i", _array(_MIB, b"\x90"))[ENVELOPE_BYTES - TAG_BYTES : -TAG_BYTES]
    full = body + b"\x90" * (8 * _MIB - ENVELOPE_BYTES - len(body))  # 8 MiB sealed
    data = {
        "bare": full,
        "under another key": BatchKey(b"another secret").seal(full),
        "sealed, too large": sealed(full + b"\x90"),
    }[shape]
    tracemalloc.start()
    try:
        with pytest.raises(MalformedBatch) as refused:
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(refused.value, BadSignature) == (shape != "sealed, too large")
    assert peak < 64 << 10, f"{peak} bytes for a {len(data) / _MIB:.1f} MiB batch"
