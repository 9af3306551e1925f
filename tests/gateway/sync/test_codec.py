"""The sync wire format: round trips, and nothing but `MalformedBatch` from bad bytes."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sync.codec import (
    MAX_BATCH_KEYS,
    MAX_CLOCK_SKEW_S,
    PUBLISH_BATCH_KEYS,
    ClockSkewed,
    MalformedBatch,
    SyncBatch,
)
from policies.base import WorkerId
from policies.peer_sync import PeerCalibration, PeerHolding, PeerItem, PeerLoad, PeerOutcome
from prompt_normalizer.types import BlockKey
from tests.gateway.sync.signed import decode, doc_of, encode, sealed

_NAMES = st.sampled_from(["p", "chat", "tenant:a", "tenant:b", "public", "http://10.0.0.1:8000"])
_HOLDING = st.builds(
    PeerHolding,
    st.integers(0, 2**40),
    _NAMES,
    st.integers(1, 64),
    _NAMES,
    st.lists(st.integers(0, 2**64 - 1).map(BlockKey), max_size=40).map(tuple),
    _NAMES.map(WorkerId),
    st.integers(0, 2**20),
    st.integers(0, 2**20),
)
_ITEM: st.SearchStrategy[PeerItem] = st.one_of(
    _HOLDING, st.builds(PeerOutcome, st.integers(0, 2**40), st.booleans())
)
_SAMPLE = st.builds(
    PeerCalibration,
    _NAMES,
    st.integers(1, 64),
    st.integers(0, 2**20),
    st.integers(0, 2**20),
    st.floats(0, 5.0),
)
_LOAD = st.builds(
    PeerLoad,
    _NAMES,
    _NAMES.map(WorkerId),
    st.integers(0, 999),
    st.integers(0, 10**7),
    st.integers(0, 10**6),
    st.one_of(st.just(0), st.integers(0, 10**8)),
)


@settings(max_examples=100, deadline=None)
@given(
    st.text(min_size=1, max_size=30),
    st.integers(0, 2**40),
    st.floats(0, 2e9),
    st.booleans(),
    st.lists(_ITEM, max_size=12),
    st.lists(_SAMPLE, max_size=4),
    st.lists(_LOAD, max_size=6),
    st.one_of(st.just(0.0), st.floats(0, 10.0)),
)
def test_a_batch_survives_the_wire(
    origin: str,
    seq: int,
    sent: float,
    full: bool,
    items: list[PeerItem],
    samples: list[PeerCalibration],
    loads: list[PeerLoad],
    waited: float,
) -> None:
    # Calibration samples travel after the holdings and outcomes (their order is immaterial).
    batch = SyncBatch(origin, seq, sent, full, (*items, *samples), tuple(loads), waited)
    assert decode(encode(batch), now_wall_s=sent) == batch


def test_calibration_samples_are_an_optional_field_of_version_1() -> None:
    sample = PeerCalibration("p", 16, 2176, 544, 1.25)
    batch = SyncBatch("gw-a", 1, 0.0, False, (PeerOutcome(3, True), sample))
    doc = doc_of(encode(batch))
    assert doc["c"] == [[0, 16, 2176, 544, 1.25]] and doc["i"] == [[1, 3, True]]
    # An earlier release's reader takes the fields it knows and leaves "c" alone...
    del doc["c"]
    # ...and a batch without it (an earlier release's writer) carries no samples.
    assert decode(sealed(doc), now_wall_s=0.0).items == (PeerOutcome(3, True),)
    assert "c" not in doc_of(encode(SyncBatch("gw-a", 2, 0.0, False)))


def test_decode_contexts_are_an_optional_field_of_version_1() -> None:
    loads = (PeerLoad("p", WorkerId("w0"), 2, 0, 64, 5000), PeerLoad("p", WorkerId("w1"), 1, 10, 8))
    doc = doc_of(encode(SyncBatch("gw-a", 1, 0.0, True, (), loads)))
    assert doc["x"] == [5000, 0] and doc["l"] == [[0, 0, 2, 0, 64], [0, 1, 1, 10, 8]]
    # An earlier release's reader leaves "x" alone; a batch without it (an earlier release's
    # writer) has loads whose decode context is not counted.
    del doc["x"]
    got = decode(sealed(doc), now_wall_s=0.0).loads
    assert [x.decode_context_tokens for x in got] == [0, 0] and got[0].decode_tokens == 64
    bare = SyncBatch("gw-a", 2, 0.0, True, (), (PeerLoad("p", WorkerId("w0"), 1, 10, 8),))
    assert "x" not in doc_of(encode(bare))


def test_prefill_pairs_are_an_optional_field_of_version_1() -> None:
    loads = (
        PeerLoad("p", WorkerId("w0"), 2, 9000, 64, 0, 40_500_000),
        PeerLoad("p", WorkerId("w1"), 1, 10, 8),
    )
    doc = doc_of(encode(SyncBatch("gw-a", 1, 0.0, True, (), loads)))
    assert doc["y"] == [40_500_000, 0] and "x" not in doc
    assert decode(sealed(doc), now_wall_s=0.0).loads == loads
    del doc["y"]  # an earlier release's writer: its loads' attention is not counted
    got = decode(sealed(doc), now_wall_s=0.0).loads
    assert [x.prefill_pairs for x in got] == [0, 0] and got[0].prefill_tokens == 9000


def test_the_first_items_wait_is_an_optional_field_of_version_1() -> None:
    doc = doc_of(encode(SyncBatch("gw-a", 1, 0.0, False, (PeerOutcome(3, True),), (), 0.004)))
    assert doc["a"] == 0.004
    del doc["a"]  # an earlier release's writer: no wait said
    assert decode(sealed(doc), now_wall_s=0.0).waited_s == 0.0
    assert "a" not in doc_of(encode(SyncBatch("gw-a", 2, 0.0, False)))


def test_the_wire_carries_the_documented_fields_only() -> None:
    keys = (BlockKey(1), BlockKey(2**64 - 1))
    batch = SyncBatch(
        "gw-a", 3, 1.5, False,
        (PeerHolding(7, "p", 16, "tenant:a", keys, WorkerId("w0"), 40, 16), PeerOutcome(7, True)),
        (PeerLoad("p", WorkerId("w0"), 1, 40, 8),),
    )  # fmt: skip
    doc = doc_of(encode(batch))
    assert set(doc) == {"o", "s", "t", "f", "p", "n", "w", "i", "k", "l"}
    assert doc["n"] == ["tenant:a"] and doc["w"] == ["w0"] and len(doc["k"]) == 16
    assert doc["i"] == [[0, 7, 0, 16, 0, 0, 2, 40, 16], [1, 7, True]]


def _doc(**over: object) -> bytes:
    doc = {"o": "a", "s": 1, "t": 0.0, "f": False, "p": ["p"], "n": ["t"], "w": ["w"]}
    doc.update({"i": [[0, 1, 0, 16, 0, 0, 1, 16, 0]], "k": b"\x00" * 8, "l": [[0, 0, 1, 2, 3]]})
    doc.update(over)
    return sealed(doc)


@pytest.mark.parametrize(
    "data",
    [
        sealed(b""),
        sealed(b"\xc1"),
        sealed(msgpack.packb([1, 2])),
        _doc(k=b"\x00" * 7),
        _doc(k=b""),  # a holding names one key, none is sent
        _doc(k=b"\x00" * 16),  # one key left over
        _doc(i=[[0, 1, 5, 16, 0, 0, 1, 16, 0]]),  # pool index out of range
        _doc(i=[[0, 1, -1, 16, 0, 0, 1, 16, 0]]),  # a negative index is not the last name
        _doc(i=[[0, 1, 0, 0, 0, 0, 1, 16, 0]]),  # block size 0
        _doc(i=[[2, 1]]),
        _doc(i=[[1, 1, 1]]),  # served must be a boolean
        _doc(i="xyz"),
        _doc(l=[[0, 0, -1, 0, 0]]),
        _doc(l=[[0, 0, 1]]),
        _doc(p=[1]),
        _doc(o=5),
        _doc(f=1),
        _doc(c=[[0, 16, 100, 25]]),  # a calibration sample short of a field
        _doc(c=[[1, 16, 100, 25, 1.0]]),  # pool index out of range
        _doc(c=[[0, 0, 100, 25, 1.0]]),  # block size 0
        _doc(c=[[0, 16, -1, 25, 1.0]]),
        _doc(c=[[0, 16, 100, 25, -1.0]]),
        _doc(c=[[0, 16, 100, 25, float("nan")]]),
        _doc(c=[[0, 16, 100, 25, float("inf")]]),
        _doc(c=[[0, 16, 100, 25, True]]),
        _doc(c="xyz"),
        _doc(x=[5, 6]),  # one decode context per load row
        _doc(x=[-1]),
        _doc(x=[True]),
        _doc(x="xyz"),
        _doc(y=[5, 6]),  # one prefill attention per load row
        _doc(y=[3]),  # 2 prefill tokens have at most 2 pairs
        _doc(y=[-1]),
        _doc(y=[1.5]),
        _doc(y="xyz"),
        _doc(a=-0.001),  # the first item's wait
        _doc(a=float("nan")),
        _doc(a=1e9),
        _doc(a=True),
        _doc(a="1"),
    ],
)
def test_anything_else_is_a_malformed_batch(data: bytes) -> None:
    assert decode(_doc(), now_wall_s=0.0).loads  # each case differs from a good batch by what it says
    with pytest.raises(MalformedBatch):
        decode(data, now_wall_s=0.0)


@pytest.mark.parametrize(
    "sent",
    [
        float("inf"),
        float("-inf"),
        float("nan"),
        1e308,
        -1e308,
        1.0 + MAX_CLOCK_SKEW_S + 1.0,
        -MAX_CLOCK_SKEW_S - 1.0,
    ],
)
def test_a_send_time_not_finite_or_far_from_the_receivers_clock_is_malformed(sent: float) -> None:
    # It would feed the lag histogram (an infinite sum, forever) and the peer's decision times.
    with pytest.raises(MalformedBatch):
        decode(_doc(t=sent), now_wall_s=1.0)
    with pytest.raises(MalformedBatch):
        decode(_doc(t=True), now_wall_s=1.0)
    for skew in (-MAX_CLOCK_SKEW_S, MAX_CLOCK_SKEW_S):  # hosts whose clocks differ, within the bound
        assert decode(_doc(t=1.0 + skew), now_wall_s=1.0).sent_wall_s == 1.0 + skew


def test_a_clock_far_off_is_told_apart_from_a_broken_batch() -> None:
    # A well-formed batch from a clock out of bounds is `ClockSkewed` (with its sender and skew);
    # a send time that is no time, or a broken batch whatever its send time, is not.
    for sent in (1.0 + MAX_CLOCK_SKEW_S + 1.0, -MAX_CLOCK_SKEW_S - 1.0, 1e308):
        with pytest.raises(ClockSkewed) as caught:
            decode(_doc(t=sent), now_wall_s=1.0)
        assert caught.value.origin == "a" and caught.value.skew_s == pytest.approx(sent - 1.0)
    for data in (_doc(t=float("nan")), _doc(t=float("inf")), _doc(t=1e6, k=b"\x00" * 7)):
        with pytest.raises(MalformedBatch) as broken:
            decode(data, now_wall_s=1.0)
        assert not isinstance(broken.value, ClockSkewed)


def test_a_batch_of_more_keys_than_any_gateway_publishes_is_malformed() -> None:
    def holding(n: int) -> bytes:
        return _doc(i=[[0, 1, 0, 16, 0, 0, n, n * 16, 0]], k=b"\x01" * 8 * n)

    assert len(decode(holding(MAX_BATCH_KEYS), now_wall_s=0.0).items[0].keys) == MAX_BATCH_KEYS  # type: ignore[union-attr]
    with pytest.raises(MalformedBatch):
        decode(holding(MAX_BATCH_KEYS + 1), now_wall_s=0.0)
    assert MAX_BATCH_KEYS >= 2 * PUBLISH_BATCH_KEYS  # room above what a publisher sends


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    for sent in (data, sealed(data)):  # also from a holder of the key
        with contextlib.suppress(MalformedBatch):
            decode(sent)
