"""Per-pool prefix index: which workers (probably) hold which chained block keys.

A block key identifies a whole prefix (keys are chained), so the index is a radix tree flattened
into a dict. Each worker has a capacity in index blocks and its own LRU list (block → last use);
when the list is full the oldest block is dropped, so the index forgets what the worker must have
evicted. A request's blocks are touched last-to-first, which leaves block 0 the most recent: like
vLLM's free queue, the tail of a chain goes before its head.

Holdings learned from our own routing are speculative (they expire after a short TTL) until a
completed request or a KV event confirms them. A completion confirms in place, without touching
recency (the dispatch set it), and a dispatch leaves alone a chain whose last block the worker
holds confirmed and used within `recency_resolution_s`: a warm prefix costs one lookup.

Memory is bounded three ways: each worker's list, the whole pool (`max_entries` holdings, split
evenly across workers), and each namespace (a share of `max_entries` in distinct keys).

Lookups live in `index_lookup.py`, the records in `index_types.py`.

Invariants (asserted by `check_invariants`):
1. `w in _table[k].holders` iff `k in _lru[w]`.
2. `len(_lru[w]) <= effective capacity of w`; the sum over workers is at most `max_entries`.
3. every key sits in exactly the namespace list of its entry, within that namespace's quota.
4. a speculative holding has a finite expiry, a confirmed one `inf`; `_spec_expiry` has exactly one
   record per speculative holding (so it is bounded by `max_entries`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from policies.base import WorkerId
from policies.index_lookup import lookup_prefix
from policies.index_types import CONFIRMED, NO_MATCH, Entry, IndexConfig, PrefixMatch
from policies.stats import IndexStats
from prompt_normalizer.types import BlockKey

__all__ = ["CONFIRMED", "NO_MATCH", "IndexConfig", "PrefixIndex", "PrefixMatch"]


class PrefixIndex:
    """Block key → workers, with per-worker LRU capacity, speculative expiry and namespace quotas."""

    def __init__(
        self,
        config: IndexConfig,
        block_size_tokens: int,
        namespace_share: Callable[[str], float] | None = None,
    ) -> None:
        if block_size_tokens < 1:
            raise ValueError("block_size_tokens must be >= 1")
        self.config = config
        self.block_size_tokens = block_size_tokens
        self._g = config.granularity_blocks
        self._share = namespace_share or (lambda _ns: config.namespace_share)
        self._table: dict[BlockKey, Entry] = {}
        # Per worker: block key → last use (seconds), in recency order.
        self._lru: dict[WorkerId, OrderedDict[BlockKey, float]] = {}
        self._cap_blocks: dict[WorkerId, int] = {}
        self._ns_keys: dict[str, OrderedDict[BlockKey, None]] = {}
        # One record per speculative holding, (worker, key) → expiry, in expiry order (every
        # refresh sets expiry = now + TTL and moves the record to the end).
        self._spec_expiry: OrderedDict[tuple[WorkerId, BlockKey], float] = OrderedDict()
        # An upper bound on the longest worker list, so a new worker only rescans the others when
        # someone may exceed the smaller share of `max_entries`.
        self._longest_bound = 0
        # Workers whose holdings may not be prefix-closed (a KV-event insert or removal, or a
        # collision, happened since their last clear); lookups walk them block by block.
        self._open: dict[WorkerId, None] = {}
        self._evictions = 0
        self._expirations = 0

    # -- sizing -------------------------------------------------------------------------------

    def _blocks_for_tokens(self, tokens: int) -> int:
        return max(0, tokens // (self.block_size_tokens * self._g))

    def set_capacity(self, worker: WorkerId, capacity_tokens: int) -> None:
        """Set how many tokens of prefix cache `worker` has (e.g. `num_gpu_blocks × block_size`)."""
        blocks = self._blocks_for_tokens(capacity_tokens)
        if self._cap_blocks.get(worker) == blocks and worker in self._lru:
            return
        self._ensure_worker(worker)
        self._cap_blocks[worker] = blocks
        self._trim(worker)

    def _ensure_worker(self, worker: WorkerId) -> None:
        if worker in self._lru:
            return
        if len(self._lru) >= self.config.max_workers:
            # The worker map itself is bounded: forget the worker with the fewest holdings.
            victim = min(self._lru, key=lambda w: len(self._lru[w]))
            self.forget_worker(victim)
        self._lru[worker] = OrderedDict()
        self._cap_blocks.setdefault(worker, self._blocks_for_tokens(self.config.default_capacity_tokens))
        # A new worker lowers everyone's share of the pool bound; trim only when a list may exceed it.
        if self._longest_bound > self.config.max_entries // len(self._lru):
            for w in list(self._lru):
                self._trim(w)
            self._longest_bound = max((len(lru) for lru in self._lru.values()), default=0)

    def capacity_blocks(self, worker: WorkerId) -> int:
        """The effective capacity: the worker's own, capped by its even share of `max_entries`."""
        own = self._cap_blocks.get(worker, self._blocks_for_tokens(self.config.default_capacity_tokens))
        return min(own, self.config.max_entries // max(1, len(self._lru)))

    def _namespace_quota(self, namespace: str) -> int:
        return max(1, int(self.config.max_entries * self._share(namespace)))

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], namespace: str, now_s: float) -> PrefixMatch:
        """Each worker's matched length for `keys`, walking from block 0 (see `index_lookup`)."""
        g = self._g
        probe = keys if g == 1 else keys[g - 1 :: g]
        return lookup_prefix(self._table, self._open, probe, namespace, now_s, g)

    def last_use_s(self, key: BlockKey, worker: WorkerId) -> float | None:
        """When `worker`'s holding of `key` was last recorded (None if it holds nothing there)."""
        lru = self._lru.get(worker)
        return None if lru is None else lru.get(key)

    def holds(self, key: BlockKey, worker: WorkerId, now_s: float) -> bool:
        entry = self._table.get(key)
        if entry is None:
            return False
        exp = entry.holders.get(worker)
        return exp is not None and exp > now_s

    # -- updates ------------------------------------------------------------------------------

    def record(
        self,
        keys: Sequence[BlockKey],
        worker: WorkerId,
        namespace: str,
        now_s: float,
        *,
        speculative: bool,
        n_blocks: int | None = None,
    ) -> int:
        """Note that `worker` holds the first `n_blocks` of `keys` (all by default) and make them its
        most recent; return how many of these holdings are still speculative afterwards.

        A speculative holding never downgrades a confirmed one; a confirmed one clears the TTL.
        A chain whose last block the worker holds confirmed and touched within
        `recency_resolution_s` is left as it is: its ancestors were touched by the same walk or
        later, and are confirmed (a confirmation walks a chain to its start).
        """
        self._ensure_worker(worker)
        end = len(keys) if n_blocks is None else min(n_blocks, len(keys))
        g = self._g
        last = (end // g) * g - 1
        if last < 0:
            return 0
        lru = self._lru[worker]
        if self._fresh(keys[last], worker, namespace, lru, now_s):
            return 0
        ns_keys = self._ns_keys.get(namespace)
        if ns_keys is None:
            ns_keys = self._ns_keys[namespace] = OrderedDict()
        expiry = now_s + self.config.speculative_ttl_s if speculative else CONFIRMED
        # Last block first, so block 0 ends up the most recently used.
        pending = self._touch(keys[last::-g], worker, namespace, expiry, now_s, lru, ns_keys)
        self._trim(worker)
        self._trim_namespace(namespace)
        if len(lru) > self._longest_bound:
            self._longest_bound = len(lru)
        return pending

    def confirm(
        self,
        keys: Sequence[BlockKey],
        worker: WorkerId,
        namespace: str,
        now_s: float,
        *,
        n_blocks: int | None = None,
    ) -> None:
        """Confirm `worker`'s holdings of the first `n_blocks` of `keys` (a served request) without
        changing their recency, which the dispatch set.

        From the chain's end, each speculative holding is confirmed in place, and the walk stops at
        the first block already confirmed (its ancestors are). A block the worker no longer holds
        (it expired or was evicted while the request ran) must go back at the recent end ahead of
        its ancestors, so then, and for workers fed by KV events, the whole chain is re-recorded.
        """
        end = len(keys) if n_blocks is None else min(n_blocks, len(keys))
        g = self._g
        last = (end // g) * g - 1
        if last < 0:
            return
        if worker not in self._open and worker in self._lru:
            table_get = self._table.get
            spec = self._spec_expiry
            for key in keys[last::-g]:
                entry = table_get(key)
                if entry is None or entry.namespace != namespace:
                    break
                holders = entry.holders
                old = holders.get(worker)
                if old is None:
                    break
                if old == CONFIRMED:
                    return
                holders[worker] = CONFIRMED
                entry.spec -= 1
                del spec[(worker, key)]
            else:
                return
        self.record(keys, worker, namespace, now_s, speculative=False, n_blocks=n_blocks)

    def _fresh(
        self, key: BlockKey, worker: WorkerId, namespace: str, lru: OrderedDict[BlockKey, float], now_s: float
    ) -> bool:
        """Whether `worker` holds `key` confirmed and touched it within `recency_resolution_s`."""
        resolution = self.config.recency_resolution_s
        if resolution <= 0:
            return False
        entry = self._table.get(key)
        if entry is None or entry.namespace != namespace or entry.holders.get(worker) != CONFIRMED:
            return False
        return lru[key] >= now_s - resolution

    def record_key(self, key: BlockKey, worker: WorkerId, namespace: str, now_s: float) -> None:
        """Confirm one holding, ignoring granularity (the caller placed it: KV events know depths)."""
        self._ensure_worker(worker)
        self._open[worker] = None
        ns_keys = self._ns_keys.get(namespace)
        if ns_keys is None:
            ns_keys = self._ns_keys[namespace] = OrderedDict()
        lru = self._lru[worker]
        self._touch((key,), worker, namespace, CONFIRMED, now_s, lru, ns_keys)
        self._trim(worker)
        self._trim_namespace(namespace)
        if len(lru) > self._longest_bound:
            self._longest_bound = len(lru)

    def _touch(
        self,
        keys: Sequence[BlockKey],
        worker: WorkerId,
        namespace: str,
        expiry: float,
        now_s: float,
        lru: OrderedDict[BlockKey, float],
        ns_keys: OrderedDict[BlockKey, None],
    ) -> int:
        """Record `worker`'s holding of each of `keys`, in order (the last ends most recent);
        return how many of them stay speculative.

        One loop over the whole chain with the tables bound to locals: this runs on every dispatch,
        and a call per block cost more than the work it did. A block the worker already holds
        confirmed (the common case: a warm prefix) costs three lookups and two moves."""
        table_get = self._table.get
        table = self._table
        spec = self._spec_expiry
        speculative = expiry != CONFIRMED
        move_lru = lru.move_to_end
        move_ns = ns_keys.move_to_end
        pending = 0
        for key in keys:
            entry = table_get(key)
            if entry is None:
                entry = table[key] = Entry(namespace)
                entry.holders[worker] = expiry
                if speculative:
                    entry.spec = 1
                    spec[(worker, key)] = expiry
                    pending += 1
                lru[key] = now_s
                ns_keys[key] = None
                continue
            if entry.namespace != namespace:
                self._open[worker] = None
                continue  # a 64-bit collision across namespaces: keep the first owner, never share
            holders = entry.holders
            old = holders.get(worker)
            if old is None:
                holders[worker] = expiry
                if speculative:
                    entry.spec += 1
                    spec[(worker, key)] = expiry
                    pending += 1
                lru[key] = now_s
            else:
                if old != CONFIRMED:
                    if speculative:
                        pending += 1
                        if expiry > old:
                            holders[worker] = expiry
                            spec[(worker, key)] = expiry
                            spec.move_to_end((worker, key))
                    else:
                        holders[worker] = CONFIRMED
                        entry.spec -= 1
                        del spec[(worker, key)]
                if len(holders) > 1 and next(reversed(holders)) != worker:
                    holders[worker] = holders.pop(worker)  # holders are kept in recency order
                move_lru(key)
                lru[key] = now_s
            move_ns(key)
        return pending

    def remove(self, key: BlockKey, worker: WorkerId) -> bool:
        """Forget one holding (a KV `BlockRemoved`); returns whether it existed."""
        entry = self._table.get(key)
        if entry is None or worker not in entry.holders:
            return False
        self._open[worker] = None
        self._lru[worker].pop(key, None)
        self._drop_holding(key, entry, worker)
        return True

    def forget_worker(self, worker: WorkerId) -> None:
        """Forget everything about `worker` (cache cleared, or the worker left the pool)."""
        lru = self._lru.pop(worker, None)
        self._cap_blocks.pop(worker, None)
        self._open.pop(worker, None)
        if lru is None:
            return
        for key in lru:
            entry = self._table.get(key)
            if entry is not None and worker in entry.holders:
                self._drop_holding(key, entry, worker)

    def clear_worker(self, worker: WorkerId) -> None:
        """Drop every holding of `worker` but keep its capacity (vLLM `AllBlocksCleared`)."""
        cap = self._cap_blocks.get(worker)
        self.forget_worker(worker)
        if cap is not None:
            self._ensure_worker(worker)
            self._cap_blocks[worker] = cap

    def expire(self, now_s: float) -> None:
        """Drop speculative holdings whose TTL has passed. O(1) per expired holding."""
        spec = self._spec_expiry
        while spec:
            (worker, key), expiry = next(iter(spec.items()))
            if expiry > now_s:
                return
            self._lru[worker].pop(key, None)
            self._drop_holding(key, self._table[key], worker)
            self._expirations += 1

    def drop_speculative(self, keys: Sequence[BlockKey], worker: WorkerId, namespace: str) -> int:
        """Forget `worker`'s unconfirmed holdings of `keys` (its request failed: it may have
        computed none of them). Confirmed holdings stay. Returns how many were dropped."""
        spec = self._spec_expiry
        dropped = 0
        for key in keys:
            if (worker, key) not in spec:
                continue
            entry = self._table[key]
            if entry.namespace != namespace:
                continue
            self._lru[worker].pop(key, None)
            self._drop_holding(key, entry, worker)
            dropped += 1
        return dropped

    def _drop_holding(self, key: BlockKey, entry: Entry, worker: WorkerId) -> None:
        exp = entry.holders.pop(worker)
        if exp != CONFIRMED:
            entry.spec -= 1
            del self._spec_expiry[(worker, key)]
        if not entry.holders:
            del self._table[key]
            ns_keys = self._ns_keys.get(entry.namespace)
            if ns_keys is not None:
                ns_keys.pop(key, None)
                if not ns_keys:
                    del self._ns_keys[entry.namespace]

    def _trim(self, worker: WorkerId) -> None:
        lru = self._lru.get(worker)
        if lru is None:
            return
        cap = self.capacity_blocks(worker)
        while len(lru) > cap:
            key, _ = lru.popitem(last=False)
            self._drop_holding(key, self._table[key], worker)
            self._evictions += 1

    def _trim_namespace(self, namespace: str) -> None:
        ns_keys = self._ns_keys.get(namespace)
        if ns_keys is None:
            return
        quota = self._namespace_quota(namespace)
        while len(ns_keys) > quota:
            key = next(iter(ns_keys))
            entry = self._table[key]
            for w in list(entry.holders):
                self._lru[w].pop(key, None)
                self._drop_holding(key, entry, w)
                self._evictions += 1
            if namespace not in self._ns_keys:
                return

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> IndexStats:
        return IndexStats(
            keys=len(self._table),
            entries=sum(len(lru) for lru in self._lru.values()),
            speculative_entries=len(self._spec_expiry),
            workers=len(self._lru),
            keys_by_namespace={ns: len(k) for ns, k in self._ns_keys.items()},
            evictions=self._evictions,
            expirations=self._expirations,
        )

    def entries_of(self, worker: WorkerId) -> int:
        lru = self._lru.get(worker)
        return 0 if lru is None else len(lru)

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (tests call this; O(size))."""
        total = 0
        for w, lru in self._lru.items():
            assert len(lru) <= self.capacity_blocks(w), f"worker {w} over capacity"
            total += len(lru)
            for key in lru:
                entry = self._table.get(key)
                assert entry is not None and w in entry.holders, "LRU entry without a holding"
        assert total <= self.config.max_entries, "pool over max_entries"
        speculative = 0
        ns_seen: dict[str, int] = {}
        for key, entry in self._table.items():
            assert entry.holders, "entry without holders"
            assert entry.spec == sum(1 for e in entry.holders.values() if e != CONFIRMED), "spec drifted"
            ns_seen[entry.namespace] = ns_seen.get(entry.namespace, 0) + 1
            assert key in self._ns_keys.get(entry.namespace, {}), "key missing from its namespace"
            for w, exp in entry.holders.items():
                assert key in self._lru.get(w, {}), "holding missing from the worker's LRU"
                if exp != CONFIRMED:
                    assert math.isfinite(exp), "speculative holding without expiry"
                    assert self._spec_expiry.get((w, key)) == exp, "expiry record differs from holding"
                    speculative += 1
        assert speculative == len(self._spec_expiry), "expiry records drifted from speculative holdings"
        for ns, keys in self._ns_keys.items():
            assert len(keys) == ns_seen.get(ns, 0), f"namespace {ns} list drifted"
            assert len(keys) <= self._namespace_quota(ns), f"namespace {ns} over quota"
