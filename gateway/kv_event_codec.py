"""Decoding of vLLM's KV-event payloads (msgpack `EventBatch`) into `policies.base.KvEvent`.

A batch is `[ts, events, data_parallel_rank?]` or the map form `{"ts", "events", ...}`. An event
is either array-like (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, ...]`, `["BlockRemoved", block_hashes, medium, ...]`,
`["AllBlocksCleared"]`; trailing fields may be missing) or a map tagged by `"type"` (vLLM after the
switch to map encoding; unknown keys are ignored). Only events about the GPU prefix cache of
full-attention layers reach the index; other media and KV groups are counted and skipped.

A stored chain's root block carries the request's `cache_salt` in its `extra_keys` (vLLM mixes
`[lora_name, multimodal ids..., cache_salt]` into block 0's hash). The gateway sets every salt
itself, so `salt_namespaces` (salt → key namespace) tells whose chain it is: the event gets that
`namespace`. A root block whose extra keys carry strings but no known salt belongs to requests
that did not come through this gateway: it is skipped, since none of our requests can hit it.
Token ids are range-checked (0 ≤ id < 2^32) and never appear in an error message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from policies.base import EngineBlockHash, KvEvent, KvEventKind

# Media whose blocks live on the worker's GPU (None: builds before the `medium` field existed).
GPU_MEDIA: frozenset[str | None] = frozenset({None, "GPU", "gpu"})
# Hybrid models publish one event stream per KV-cache group; only full attention maps to prefixes.
PREFIX_SPEC_KINDS: frozenset[str | None] = frozenset({None, "full_attention"})
MAX_TOKEN_ID = 2**32 - 1


class KvEventDecodeError(ValueError):
    """A payload that is not a vLLM `EventBatch`; the message says which part is wrong (never a value)."""


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One decoded `EventBatch`: the events the gateway cares about, plus how many were filtered out."""

    ts_s: float
    events: tuple[KvEvent, ...]
    skipped_events: int = 0
    data_parallel_rank: int | None = None


def _as_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _hashes(value: Any, what: str) -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list | tuple):
        raise KvEventDecodeError(f"{what}: expected a list of block hashes, got {type(value).__name__}")
    out: list[EngineBlockHash] = []
    for h in value:
        if isinstance(h, bool) or not isinstance(h, int | bytes):
            raise KvEventDecodeError(f"{what}: a block hash must be int or bytes, got {type(h).__name__}")
        out.append(h)
    return tuple(out)


def _optional_hash(value: Any, what: str) -> EngineBlockHash | None:
    if value is None:
        return None
    return _hashes([value], what)[0]


def _token_ids(value: Any, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    ):
        raise KvEventDecodeError(f"{what}: expected a list of token ids in [0, 2^32)")
    return tuple(value)


_UNSALTED = ""
_FOREIGN = None


def _root_salt_namespace(
    extra_keys: Any, lora_name: str | None, salt_namespaces: Mapping[str, str]
) -> str | None:
    """The namespace of a root block's salt: "" when it carries no salt, None when its salt is unknown."""
    if not isinstance(extra_keys, list | tuple) or not extra_keys:
        return _UNSALTED
    first = extra_keys[0]
    if not isinstance(first, list | tuple):
        return _UNSALTED
    candidates = [k for k in first if isinstance(k, str) and k != lora_name]
    for key in candidates:
        namespace = salt_namespaces.get(key)
        if namespace is not None:
            return namespace
    return _UNSALTED if not candidates else _FOREIGN


# Positional field names of the array-like encoding, in vLLM's declaration order (after the tag).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _fields(raw: Any) -> tuple[str, Mapping[Any, Any]]:
    """Normalize one event (array-like or map) to its tag and a field mapping."""
    if isinstance(raw, Mapping):
        tag = _as_str(raw.get("type"))
        if tag is None:
            raise KvEventDecodeError("event map has no 'type'")
        return tag, raw
    if isinstance(raw, list | tuple) and raw:
        tag = _as_str(raw[0]) or ""
        names: tuple[str, ...] = ()
        if tag == "BlockStored":
            names = _STORED_FIELDS
        elif tag == "BlockRemoved":
            names = _REMOVED_FIELDS
        return tag, dict(zip(names, raw[1:], strict=False))
    raise KvEventDecodeError(f"an event must be a non-empty array or a map, got {type(raw).__name__}")


def decode_event(raw: Any, salt_namespaces: Mapping[str, str] | None = None) -> KvEvent | None:
    """Decode one event; None for events the prefix index must not see (other media, unknown types,
    chains salted by someone else)."""
    tag, f = _fields(raw)
    if tag == "AllBlocksCleared":
        return KvEvent(kind=KvEventKind.ALL_BLOCKS_CLEARED)
    if tag not in ("BlockStored", "BlockRemoved"):
        return None
    if _as_str(f.get("medium")) not in GPU_MEDIA:
        return None
    if _as_str(f.get("kv_cache_spec_kind")) not in PREFIX_SPEC_KINDS:
        return None
    hashes = _hashes(f.get("block_hashes"), f"{tag}.block_hashes")
    if tag == "BlockRemoved":
        return KvEvent(kind=KvEventKind.BLOCK_REMOVED, block_hashes=hashes)
    block_size = f.get("block_size", 0)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
        raise KvEventDecodeError("BlockStored.block_size: expected a non-negative int")
    parent = _optional_hash(f.get("parent_block_hash"), "BlockStored.parent_block_hash")
    lora_name = _as_str(f.get("lora_name"))
    namespace: str | None = None
    if parent is None and salt_namespaces is not None:
        # Only a chain's first block carries the salt; later runs follow their parent's namespace.
        found = _root_salt_namespace(f.get("extra_keys"), lora_name, salt_namespaces)
        if found is _FOREIGN:
            return None
        namespace = found or None
    return KvEvent(
        kind=KvEventKind.BLOCK_STORED,
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=_token_ids(f.get("token_ids"), "BlockStored.token_ids"),
        block_size=block_size,
        lora_name=lora_name,
        namespace=namespace,
    )


def decode_batch(payload: bytes, salt_namespaces: Mapping[str, str] | None = None) -> DecodedBatch:
    """Decode a msgpack `EventBatch` (array or map form); raises `KvEventDecodeError`."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise KvEventDecodeError(f"payload is not msgpack: {type(exc).__name__}") from None
    if isinstance(raw, Mapping):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvEventDecodeError("batch must be [ts, events, dp_rank?] or a map with 'events'")
    if not isinstance(events, list | tuple):
        raise KvEventDecodeError("batch.events: expected a list")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KvEventDecodeError("batch.ts: expected a number")
    decoded: list[KvEvent] = []
    skipped = 0
    for item in events:
        ev = decode_event(item, salt_namespaces)
        if ev is None:
            skipped += 1
        else:
            decoded.append(ev)
    return DecodedBatch(
        ts_s=float(ts),
        events=tuple(decoded),
        skipped_events=skipped,
        data_parallel_rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
    )
