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

This module records holdings; their tables, bounds, expiry, removal and invariants are
`index_holdings.py`'s, lookups live in `index_lookup.py`, the records in `index_types.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.base import WorkerId
from policies.index_holdings import IndexHoldings
from policies.index_lookup import lookup_prefix
from policies.index_types import CONFIRMED, NO_MATCH, Entry, IndexConfig, PrefixMatch
from prompt_normalizer.types import BlockKey

__all__ = ["CONFIRMED", "NO_MATCH", "IndexConfig", "PrefixIndex", "PrefixMatch"]


class PrefixIndex(IndexHoldings):
    """Block key → workers, with per-worker LRU capacity, speculative expiry and namespace quotas."""

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
        lru = self._lru.get(worker)
        if lru is None:
            if not self._ensure_worker(worker):
                return 0  # retired: it left the pool
            lru = self._lru[worker]
        end = self._held_end(keys, worker, n_blocks)
        g = self._g
        last = (end // g) * g - 1
        if last < 0:
            return 0
        resolution = self.config.recency_resolution_s
        if resolution > 0:
            # Held confirmed and touched within the resolution: a warm prefix's dispatch ends here.
            entry = self._table.get(keys[last])
            if (
                entry is not None
                and entry.namespace == namespace
                and entry.holders.get(worker) == CONFIRMED
                and lru[keys[last]] >= now_s - resolution
            ):
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
        end = self._held_end(keys, worker, n_blocks)
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

    def _held_end(self, keys: Sequence[BlockKey], worker: WorkerId, n_blocks: int | None) -> int:
        """How many of `keys` a record or confirmation walks: the first `n_blocks` (all by default),
        but no more than `worker`'s capacity. Its blocks are touched last first, so past the
        capacity the walk would only evict its own deepest blocks again: a 1.7M-token prompt's
        110,000 keys cost 0.4 s of the event loop to record, to keep the first 24,000."""
        end = len(keys) if n_blocks is None else min(n_blocks, len(keys))
        own = self._cap_blocks.get(worker)  # `capacity_blocks`, inlined
        if own is None:
            own = self._blocks_for_tokens(self.config.default_capacity_tokens)
        n_workers = len(self._lru)
        share = self.config.max_entries // (n_workers if n_workers > 1 else 1)
        cap = (own if own < share else share) * self._g
        return cap if end > cap else end

    def record_key(self, key: BlockKey, worker: WorkerId, namespace: str, now_s: float) -> None:
        """Confirm one holding, ignoring granularity (the caller placed it: KV events know depths)."""
        if not self._ensure_worker(worker):
            return  # retired: it left the pool
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
