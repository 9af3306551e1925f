"""Precise mode: feed the index from a worker's KV-cache events.

Engines hash blocks with salts and digests a router cannot reproduce, so we keep our own key for
every stored block, computed from the block's token ids with the same chained hash the normalizer
uses for token-exact keys, and a per-worker map engine hash → (our key, depth) to resolve parents
and removals (the dual-key pattern of shared/reference/routers-k8s-dynamo-kv-events.md §4, §8).

A block whose parent we never saw cannot be placed (its prefix is unknown): it is counted as an
orphan and dropped. Root blocks (no parent) are keyed under the feed's namespace: with per-tenant
`cache_salt` the event does not say whose block it is, so precise mode serves pools whose tenants
share one namespace (the public one by default).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import xxhash

from policies.base import EngineBlockHash, KvEvent, KvEventKind, WorkerId
from policies.index import PrefixIndex
from prompt_normalizer.keys import TOKEN_DTYPE, TOKEN_UNIT, root_key, secret_key
from prompt_normalizer.types import BlockKey, KeyIdentity

_U64 = (1 << 64) - 1


class TokenBlockHasher(Protocol):
    """Chained token-block hash: `root(namespace)` seeds block 0, `chain(parent, tokens)` the rest."""

    def root(self, namespace: str, lora_name: str | None) -> int: ...

    def chain(self, parent: int, token_ids: Sequence[int]) -> BlockKey: ...


class NormalizerTokenHasher:
    """Keys KV-event blocks exactly as the normalizer keys token prompts (tokenizer/render modes):
    root = keyed BLAKE2b of the identity under `TOKEN_UNIT`, then xxh3-64 of each block's
    little-endian u32 token ids seeded with the parent key (`prompt_normalizer.keys`).

    `identity` is the pool's key identity; the namespace (and adapter, from the event's LoRA name)
    is filled in per root block.
    """

    def __init__(self, secret: bytes, identity: KeyIdentity) -> None:
        self._key = secret_key(secret)
        self._identity = identity
        self._roots: dict[tuple[str, str | None], int] = {}

    def root(self, namespace: str, lora_name: str | None) -> int:
        found = self._roots.get((namespace, lora_name))
        if found is None:
            adapter = lora_name if lora_name is not None else self._identity.adapter
            ident = dataclasses.replace(self._identity, namespace=namespace, adapter=adapter)
            found = root_key(self._key, ident, TOKEN_UNIT)
            if len(self._roots) > 4096:
                self._roots.clear()
            self._roots[(namespace, lora_name)] = found
        return found

    def chain(self, parent: int, token_ids: Sequence[int]) -> BlockKey:
        data = np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()
        return BlockKey(xxhash.xxh3_64_intdigest(data, seed=parent & _U64))


class XxhTokenHasher:
    """xxh3-64 over the block's token ids as little-endian u32, seeded with the parent key.

    `root_seed` should come from the deployment secret and the key identity, exactly as the
    normalizer derives its root, so that event keys and request keys coincide.
    """

    def __init__(self, root_seed: int) -> None:
        self._root_seed = root_seed & _U64

    def root(self, namespace: str, lora_name: str | None) -> int:
        return xxhash.xxh3_64_intdigest(f"{namespace}\x00{lora_name or ''}".encode(), seed=self._root_seed)

    def chain(self, parent: int, token_ids: Sequence[int]) -> BlockKey:
        data = np.asarray(token_ids, dtype="<u4").tobytes()
        return BlockKey(xxhash.xxh3_64_intdigest(data, seed=parent & _U64))


def normalize_engine_hash(h: EngineBlockHash) -> int:
    """vLLM sends ints (low 64 bits) or raw digests; take the last 8 bytes big-endian, as llm-d does."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & _U64


class KvEventFeed:
    """Applies one pool's KV events to its index (confirmed holdings) through the dual-key map."""

    def __init__(self, index: PrefixIndex, hasher: TokenBlockHasher, namespace: str) -> None:
        self.index = index
        self.hasher = hasher
        self.namespace = namespace
        self._maps: dict[WorkerId, OrderedDict[int, tuple[BlockKey, int]]] = {}
        self.orphans = 0
        self.mismatched = 0
        self.applied = 0

    def _map(self, worker: WorkerId) -> OrderedDict[int, tuple[BlockKey, int]]:
        m = self._maps.get(worker)
        if m is None:
            m = self._maps[worker] = OrderedDict()
        return m

    def apply(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        if event.kind is KvEventKind.ALL_BLOCKS_CLEARED:
            self._maps.pop(worker, None)
            self.index.clear_worker(worker)
        elif event.kind is KvEventKind.BLOCK_REMOVED:
            self._removed(worker, event)
        else:
            self._stored(worker, event, now_s)
        self.applied += 1

    def _stored(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        bs = self.index.block_size_tokens
        if event.block_size != bs or len(event.token_ids) < bs * len(event.block_hashes):
            # Another block size, or a tier event without tokens: we cannot key it.
            self.mismatched += 1
            return
        m = self._map(worker)
        if event.parent_block_hash is None:
            prev = self.hasher.root(self.namespace, event.lora_name)
            depth = 0
        else:
            parent = m.get(normalize_engine_hash(event.parent_block_hash))
            if parent is None:
                self.orphans += 1
                return
            prev, depth = parent[0], parent[1] + 1
        g = self.index.config.granularity_blocks
        limit = max(1, 2 * self.index.capacity_blocks(worker) * g)
        tokens = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            key = self.hasher.chain(prev, tokens[i * bs : (i + 1) * bs])
            m[normalize_engine_hash(engine_hash)] = (key, depth)
            if (depth + 1) % g == 0:
                self.index.record_key(key, worker, self.namespace, now_s)
            prev = key
            depth += 1
        while len(m) > limit:
            m.popitem(last=False)

    def _removed(self, worker: WorkerId, event: KvEvent) -> None:
        m = self._maps.get(worker)
        if m is None:
            return
        for engine_hash in event.block_hashes:
            found = m.pop(normalize_engine_hash(engine_hash), None)
            if found is not None:
                self.index.remove(found[0], worker)
