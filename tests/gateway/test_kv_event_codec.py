"""KV-event payload decoding: vLLM's array and map encodings, old and odd events, bad payloads."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from gateway.kv_event_types import endpoint_for_worker
from gateway.kv_events import KvEventDecodeError, decode_batch
from policies.base import KvEvent, KvEventKind
from tests.gateway.kv_event_payloads import BIG_HASH, batch, stored_array, stored_map


def test_array_and_map_encodings_decode_to_the_same_events() -> None:
    a = decode_batch(batch([stored_array([1, BIG_HASH], None), ["BlockRemoved", [1], "GPU", 0]]))
    m = decode_batch(
        batch([stored_map([1, BIG_HASH], None), {"type": "BlockRemoved", "block_hashes": [1]}], "map")
    )
    assert a.events == m.events
    stored, removed = a.events
    assert stored == KvEvent(
        kind=KvEventKind.BLOCK_STORED,
        block_hashes=(1, BIG_HASH),
        parent_block_hash=None,
        token_ids=(0, 1, 2, 3),
        block_size=2,
    )
    assert removed == KvEvent(kind=KvEventKind.BLOCK_REMOVED, block_hashes=(1,))
    assert m.data_parallel_rank == 0 and a.ts_s == 1.5


def test_old_short_events_and_byte_hashes() -> None:
    # Builds before `medium`/`lora_name`: trailing fields missing; sha256 digests as bytes.
    h = bytes(range(32))
    out = decode_batch(msgpack.packb([2.0, [["BlockStored", [h], 7, [5, 6], 2, None], ["AllBlocksCleared"]]]))
    assert out.events[0].block_hashes == (h,)
    assert out.events[0].parent_block_hash == 7
    assert out.events[1].kind is KvEventKind.ALL_BLOCKS_CLEARED


def test_other_media_groups_and_unknown_types_are_skipped() -> None:
    out = decode_batch(
        batch(
            [
                stored_array([1], None, medium="CPU"),
                stored_array([2], None, spec_kind="sliding_window"),
                ["SomethingNew", 1, 2],
                stored_array([3], None, lora_name="adapter-a"),
            ]
        )
    )
    assert out.skipped_events == 3
    assert [e.block_hashes for e in out.events] == [(3,)]
    assert out.events[0].lora_name == "adapter-a"


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xc1\xc1", "not msgpack"),
        (msgpack.packb({"ts": 1.0}), "events"),
        (msgpack.packb([1.0]), "batch must be"),
        (msgpack.packb([1.0, [["BlockStored", "nope", None, [], 2]]]), "block_hashes"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, ["x"], 2]]]), "token_ids"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [-1, 7], 2]]]), "token_ids"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [2**32, 7], 2]]]), "token_ids"),
        (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "type"),
        (msgpack.packb(["x", []]), "ts"),
    ],
)
def test_bad_payloads_say_what_is_wrong(payload: bytes, needle: str) -> None:
    with pytest.raises(KvEventDecodeError, match=needle):
        decode_batch(payload)


def test_bad_token_ids_never_appear_in_the_error() -> None:
    with pytest.raises(KvEventDecodeError) as info:
        decode_batch(msgpack.packb([1.0, [["BlockStored", [1], None, [123456789, -987654321], 2]]]))
    assert "123456789" not in str(info.value) and "987654321" not in str(info.value)


def _salted(parent: int | None, extra_first: Any, lora: str | None = None) -> list[Any]:
    ev = stored_array([11, 12], parent, lora_name=lora)
    ev[8] = [extra_first, None]
    return ev


def test_root_block_salt_names_the_namespace() -> None:
    salts = {"salt-a": "tenant:a", "salt-pub": "public"}
    events = [
        _salted(None, ["salt-a"]),  # the emulator's form
        _salted(None, ["sql-lora", "mm-hash", "salt-pub"], lora="sql-lora"),  # vLLM: lora, mm ids, salt
        _salted(None, None),  # unsalted chain
        _salted(7, None),  # a continuation: its parent knows the namespace
        _salted(None, ["salt-of-someone-else"]),  # foreign salt: nobody routed here can hit it
        _salted(None, ["sql-lora"], lora="sql-lora"),  # an adapter name alone is no salt
    ]
    out = decode_batch(batch(events), salts)
    assert [e.namespace for e in out.events] == ["tenant:a", "public", None, None, None]
    assert out.skipped_events == 1
    # Without a salt map (tools, tests) nothing is resolved or dropped.
    assert [e.namespace for e in decode_batch(batch(events)).events] == [None] * 6


def test_endpoint_template() -> None:
    assert endpoint_for_worker("tcp://{host}:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert endpoint_for_worker("tcp://{host}:5557", "http://[::1]:8000") == "tcp://[::1]:5557"
