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

A batch is read one event at a time (`BatchReader`), so a subscriber can spread a large batch
over several turns of the event loop: msgpack's unpacking and our checks both hold the GIL, so a
thread would not keep the loop any freer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
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


_ARRAY_FIRST_BYTES = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD})
_MAP_FIRST_BYTES = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})


@dataclass(slots=True)
class BatchReader:
    """One `EventBatch`, decoded a few events per `step`: the whole batch or an error, never a
    part of it (events are handed out by `result` only once every event decoded)."""

    payload: bytes
    salt_namespaces: Mapping[str, str] | None = None
    _events: list[KvEvent] = field(default_factory=list)
    _skipped: int = 0
    _ts: object = None
    _rank: object = None
    _walk: Iterator[None] | None = None
    _done: bool = False

    def step(self, max_events: int) -> bool:
        """Decode up to `max_events` more events; True when the batch is complete. Raises
        `KvEventDecodeError`."""
        if self._walk is None:
            self._walk = self._read()
        try:
            for _ in range(max_events):
                next(self._walk)
        except StopIteration:
            self._done = True
        except KvEventDecodeError:
            raise
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise KvEventDecodeError(f"payload is not msgpack: {type(exc).__name__}") from None
        return self._done

    def result(self) -> DecodedBatch:
        assert self._done, "BatchReader.result() before the last step"
        ts, rank = self._ts, self._rank
        assert isinstance(ts, int | float)
        return DecodedBatch(
            ts_s=float(ts),
            events=tuple(self._events),
            skipped_events=self._skipped,
            data_parallel_rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        )

    def _read(self) -> Iterator[None]:
        payload = self.payload
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(payload), 1))
        unpacker.feed(payload)
        first = payload[0] if payload else -1
        if first in _ARRAY_FIRST_BYTES:
            fields = unpacker.read_array_header()
            if fields < 2:
                raise KvEventDecodeError("batch must be [ts, events, dp_rank?] or a map with 'events'")
            self._ts = unpacker.unpack()
            _check_ts(self._ts)
            yield from self._read_events(unpacker)
            for i in range(2, fields):
                value = unpacker.unpack()
                if i == 2:
                    self._rank = value
        elif first in _MAP_FIRST_BYTES:
            seen = False
            for _ in range(unpacker.read_map_header()):
                key = unpacker.unpack()
                if key == "events":
                    yield from self._read_events(unpacker)
                    seen = True
                elif key == "ts":
                    self._ts = unpacker.unpack()
                elif key == "data_parallel_rank":
                    self._rank = unpacker.unpack()
                else:
                    unpacker.skip()
            if not seen:
                raise KvEventDecodeError("batch.events: expected a list")
            _check_ts(self._ts)
        elif first in (0xC1, -1):
            raise KvEventDecodeError("payload is not msgpack: it starts with no value")
        else:
            raise KvEventDecodeError("batch must be [ts, events, dp_rank?] or a map with 'events'")
        try:
            unpacker.skip()
        except msgpack.OutOfData:
            return
        raise KvEventDecodeError("payload is not msgpack: ExtraData")

    def _read_events(self, unpacker: msgpack.Unpacker) -> Iterator[None]:
        try:
            count = unpacker.read_array_header()
        except ValueError:
            raise KvEventDecodeError("batch.events: expected a list") from None
        for _ in range(count):
            ev = decode_event(unpacker.unpack(), self.salt_namespaces)
            if ev is None:
                self._skipped += 1
            else:
                self._events.append(ev)
            yield


def _check_ts(ts: object) -> None:
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KvEventDecodeError("batch.ts: expected a number")


def decode_batch(payload: bytes, salt_namespaces: Mapping[str, str] | None = None) -> DecodedBatch:
    """Decode a msgpack `EventBatch` (array or map form) at once; raises `KvEventDecodeError`."""
    reader = BatchReader(payload, salt_namespaces)
    while not reader.step(1 << 30):
        pass
    return reader.result()
