"""Precise mode: feed the index from a worker's KV-cache events.

Engines hash blocks with salts and digests a router cannot reproduce, so we keep our own key for
every stored block, computed from the block's token ids with the same chained hash the normalizer
uses for token-exact keys, and a per-worker map engine hash → (our key, depth) to resolve parents
and removals (the dual-key pattern of shared/reference/routers-k8s-dynamo-kv-events.md §4, §8).

The hasher is the normalizer's own (`prompt_normalizer.keys.IdentityTokenHasher`, from
`Normalizer.token_hasher(identity)`), so event keys and request keys come from one implementation.

A block whose parent we never saw cannot be placed (its prefix is unknown): it is counted as an
orphan and dropped. A root block (no parent) is keyed under `KvEvent.namespace`, the tenant the
gateway resolved from the chain's `cache_salt`, or the feed's configured namespace (public by
default) when the chain is unsalted; its descendants inherit the namespace of their chain.

A worker's map says how the engine's hashes translate to our keys, not what the worker holds: it
is dropped when the worker leaves or joins the pool (`forget_worker`) or clears its cache, and
kept when health checks clear its holdings (an engine that did not restart goes on extending the
chains it mapped; one that did hashes with a new seed, and the limit below trims the old entries).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from policies.base import EngineBlockHash, KvEvent, KvEventKind, WorkerId
from policies.index import PrefixIndex
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.types import BlockKey

_U64 = (1 << 64) - 1


class TokenBlockHasher(Protocol):
    """Chained token-block hash: `root(namespace)` seeds block 0, `chain(parent, tokens)` the rest.

    `chain` raises `NormalizerError` for token ids outside [0, 2**32).
    """

    def root(self, namespace: str, lora_name: str | None) -> int: ...

    def chain(self, parent: int, token_ids: Sequence[int]) -> BlockKey: ...


def normalize_engine_hash(h: EngineBlockHash) -> int:
    """vLLM sends ints (low 64 bits) or raw digests; take the last 8 bytes big-endian, as llm-d does."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & _U64


class _Placed(NamedTuple):
    """Where an engine block sits in our keys: its key, depth and the namespace of its chain."""

    key: BlockKey
    depth: int
    namespace: str


class KvEventFeed:
    """Applies one pool's KV events to its index (confirmed holdings) through the dual-key map."""

    def __init__(self, index: PrefixIndex, hasher: TokenBlockHasher, namespace: str) -> None:
        self.index = index
        self.hasher = hasher
        self.namespace = namespace
        self._maps: dict[WorkerId, OrderedDict[int, _Placed]] = {}
        self.orphans = 0
        self.mismatched = 0
        self.bad_tokens = 0
        self.applied = 0

    def _map(self, worker: WorkerId) -> OrderedDict[int, _Placed]:
        m = self._maps.get(worker)
        if m is None:
            m = self._maps[worker] = OrderedDict()
        return m

    def forget_worker(self, worker: WorkerId) -> None:
        """Drop `worker`'s engine-hash map (it left or joined the pool; the index is told apart)."""
        self._maps.pop(worker, None)

    def apply(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        if self.index.retired(worker):
            return  # it left the pool: an event still in flight says nothing of a member
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
            namespace = event.namespace if event.namespace is not None else self.namespace
            prev = self.hasher.root(namespace, event.lora_name)
            depth = 0
        else:
            parent = m.get(normalize_engine_hash(event.parent_block_hash))
            if parent is None:
                self.orphans += 1
                return
            # The salt (hence the namespace) is bound at the chain's root: a child inherits it.
            prev, depth, namespace = parent.key, parent.depth + 1, parent.namespace
        g = self.index.config.granularity_blocks
        limit = max(1, 2 * self.index.capacity_blocks(worker) * g)
        tokens = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            try:
                key = self.hasher.chain(prev, tokens[i * bs : (i + 1) * bs])
            except NormalizerError:
                self.bad_tokens += 1  # an id outside u32: the rest of the chain cannot be keyed
                break
            m[normalize_engine_hash(engine_hash)] = _Placed(key, depth, namespace)
            if (depth + 1) % g == 0:
                self.index.record_key(key, worker, namespace, now_s)
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
                self.index.remove(found.key, worker)
