"""Sealed batches: what a holder of the broker's token makes up or alters, without the deployment's
key-hash secret, is dropped unread and counted; what the deployment's gateways seal still applies."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

import msgpack
import pytest

from gateway.config import QuotaConfig
from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.quotas import TenantLimiter, Usage
from gateway.registry import Registry
from gateway.sync.codec import SyncBatch, encode_body
from gateway.sync.signing import ENVELOPE_BYTES, TAG_BYTES, WIRE_VERSION, BadSignature, BatchKey
from gateway.sync.subscriber import SyncSubscriber
from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.identity import derive_secret
from policies.peer_sync import PeerHolding, PeerLoad
from prompt_normalizer.types import BlockKey
from tests.gateway.sync.signed import KEY, SECRET, body, decode, doc_of, encode, sealed

W0 = "http://127.0.0.1:9001"
_NOW = time.time()


def _subscriber() -> tuple[SyncSubscriber, TenantLimiter, CostPolicy]:
    registry = Registry([PoolConfig(name="p", models=["m"], workers=[W0])])
    limiter = TenantLimiter(QuotaConfig(rpm=10, tpm=10_000, max_concurrent=3), now_s=time.monotonic())
    sub = SyncSubscriber("me", registry, 5.0, GatewayMetrics(), secret=SECRET, limiters={"t": limiter})
    return sub, limiter, CostPolicy(seed=0)


def _claim(seq: int, sent_s: float) -> SyncBatch:
    """What a forger would have every gateway act on: a tenant's whole quota spent, a holding of a
    real worker, a load on it, and (with `seq`) a sequence number past the real peer's."""
    holding = PeerHolding(1, "p", 16, "tenant:t", tuple(BlockKey(k) for k in range(8)), WorkerId(W0), 128, 0)
    load = PeerLoad("p", WorkerId(W0), 50, 100_000, 1000)
    return SyncBatch("peer", seq, sent_s, True, (holding,), (load,), usage=(("t", Usage(10, 10_000, 3)),))


def _bare_v1(batch: SyncBatch) -> bytes:
    """`batch` as version 1 put it on the wire: the msgpack map alone, unsigned (what anyone who
    could publish on the subject could send, and every gateway applied)."""
    doc = msgpack.unpackb(encode_body(batch), raw=False)
    return msgpack.packb({"v": 1, **doc}, use_bin_type=True)


def _tagged_with_the_raw_secret(batch: SyncBatch) -> bytes:
    data = encode(batch)
    return data[:-TAG_BYTES] + hmac.digest(SECRET, data[:-TAG_BYTES], hashlib.sha256)


FORGERIES: dict[str, Callable[[SyncBatch], bytes]] = {
    "bare, as version 1": _bare_v1,
    "sealed under another secret": lambda batch: encode(batch, b"a secret the forger made up"),
    "a tag of zeros": lambda batch: encode(batch)[:-TAG_BYTES] + bytes(TAG_BYTES),
    "tagged with the key-hash secret itself": _tagged_with_the_raw_secret,
}


@pytest.mark.parametrize("forge", FORGERIES.values(), ids=FORGERIES.keys())
async def test_a_batch_forged_without_the_secret_is_dropped_unread_and_counted(
    forge: Callable[[SyncBatch], bytes],
) -> None:
    sub, limiter, policy = _subscriber()
    before = limiter.remaining(time.monotonic())
    await sub.on_message(forge(_claim(2**40, time.time())), lambda: policy)
    assert sub.stats.bad_signature == 1 and sub.stats.malformed == 0 and sub.stats.batches == 0
    # Nothing of it was acted on: the quota is whole, no sender's number moved, no peer, no holding.
    assert limiter.remaining(time.monotonic()) == pytest.approx(before, abs=0.01)
    assert limiter.peers_in_flight == 0 and len(sub.sequences) == 0 and sub.sequences.lost == 0
    assert sub.loads.peers() == 0 and "peer_holdings_applied" not in policy.stats().counters
    # The real peer's first batch still applies, though the forgery numbered past it.
    await sub.on_message(encode(_claim(1, time.time())), lambda: policy)
    assert sub.stats.batches == 1 and sub.loads.peers() == 1 and limiter.peers_in_flight == 3
    assert limiter.remaining(time.monotonic())["requests"] < 0.1
    assert policy.stats().counters["peer_holdings_applied"] == 1


async def test_a_batch_altered_after_it_was_sealed_is_dropped() -> None:
    sub, limiter, policy = _subscriber()
    genuine = encode(SyncBatch("peer", 1, time.time(), False, usage=(("t", Usage(1, 10, 0)),)))
    doc = doc_of(genuine)
    doc["u"] = [["t", 10, 10_000, 3]]  # the charge made the whole quota
    doc["s"] = 2**40  # and the sender's number past its next batches
    altered = genuine[: ENVELOPE_BYTES - TAG_BYTES] + msgpack.packb(doc) + genuine[-TAG_BYTES:]
    assert decode(sealed(doc)).usage == (("t", Usage(10, 10_000, 3)),)  # well formed, sealed again
    await sub.on_message(altered, lambda: policy)
    assert sub.stats.bad_signature == 1 and sub.stats.batches == 0 and len(sub.sequences) == 0
    assert limiter.remaining(time.monotonic())["requests"] == pytest.approx(10, abs=0.01)
    await sub.on_message(genuine, lambda: policy)
    assert sub.stats.batches == 1
    assert limiter.remaining(time.monotonic())["requests"] == pytest.approx(9, abs=0.01)


def test_every_bit_of_a_sealed_batch_is_covered() -> None:
    # The header (its version), the origin, the sequence number, the send time, the pools'
    # fingerprints, every item, load and quota row, and the tag itself.
    claim = _claim(1, _NOW)
    batch = SyncBatch("peer", 7, _NOW, True, claim.items, claim.loads, 0.5, (1, 2**63), claim.usage)
    data = encode(batch)
    assert decode(data, now_wall_s=_NOW) == batch
    for at in range(len(data)):
        for bit in (0, 7):
            flipped = data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1 :]
            with pytest.raises(BadSignature):
                decode(flipped, now_wall_s=_NOW)
    for cut in (data[:-1], data[1:], data + b"\x00", data[:ENVELOPE_BYTES], b""):
        with pytest.raises(BadSignature):
            decode(cut, now_wall_s=_NOW)


def test_the_key_is_a_sub_secret_of_its_own() -> None:
    # Never the key-hash secret itself, nor any other purpose's sub-secret.
    sub_secret = derive_secret(SECRET, "sync_batches")
    others = {derive_secret(SECRET, p) for p in ("cache_salt", "prefix_keys", "response_ids")}
    assert sub_secret != SECRET and sub_secret not in others
    data = encode(SyncBatch("peer", 1, _NOW, False))
    head_and_body = data[:-TAG_BYTES]
    assert data[-TAG_BYTES:] == hmac.digest(sub_secret, head_and_body, hashlib.sha256)
    assert BatchKey(b"another secret").seal(body(data)) != data


def test_the_two_versions_refuse_each_other_cleanly() -> None:
    batch = SyncBatch("peer", 1, _NOW, False, (), (PeerLoad("p", WorkerId(W0), 1, 2, 3),))
    # An earlier release reads a batch as a msgpack map: a sealed one is no map from its first
    # byte, which it counts as malformed (a ValueError, as its decoder maps every one).
    unpacker = msgpack.Unpacker(None, max_array_len=0, max_map_len=0)
    unpacker.feed(encode(batch))
    with pytest.raises(ValueError, match="Unexpected type"):
        unpacker.read_map_header()
    # This one refuses an earlier release's batch before reading it, and a later version's.
    with pytest.raises(BadSignature, match="not a signed sync batch"):
        decode(_bare_v1(batch), now_wall_s=_NOW)
    later = bytearray(encode(batch))
    later[ENVELOPE_BYTES - TAG_BYTES - 1] = WIRE_VERSION + 1
    with pytest.raises(BadSignature, match="another version"):
        decode(bytes(later), now_wall_s=_NOW)


def test_a_gateway_reads_what_its_own_key_sealed() -> None:
    batch = _claim(3, _NOW)
    assert decode(KEY.seal(encode_body(batch)), now_wall_s=_NOW) == batch
    assert len(encode(batch)) == len(encode_body(batch)) + ENVELOPE_BYTES
