"""vLLM KV-event payloads for tests: stored-block events in both encodings, and batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from policies.base import WorkerId

W = WorkerId("w1")
BIG_HASH = 2**64 - 5  # above 2**63: vLLM's low-64-bit hashes arrive as msgpack uint64


def stored_array(
    hashes: Sequence[int | bytes], parent: int | bytes | None, bs: int = 2, **kw: Any
) -> list[Any]:
    tokens = list(range(len(hashes) * bs))
    return [
        "BlockStored",
        list(hashes),
        parent,
        tokens,
        bs,
        None,
        kw.get("medium", "GPU"),
        kw.get("lora_name"),
        [None] * len(hashes),
        0,
        kw.get("spec_kind", "full_attention"),
    ]


def stored_map(hashes: Sequence[int | bytes], parent: int | bytes | None, bs: int = 2) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes) * bs)),
        "block_size": bs,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "a_field_from_the_future": 1,
    }


def batch(events: list[Any], encoding: str = "array") -> bytes:
    if encoding == "map":
        return msgpack.packb({"ts": 1.5, "events": events, "data_parallel_rank": 0})
    return msgpack.packb([1.5, events, None])


# ---------------------------------------------------------------- decoding
