"""The holdings of a prefix index (`policies.index.PrefixIndex`) and what keeps them bounded.

Memory is bounded three ways: each worker's list, the whole pool (`max_entries` holdings, split
evenly across workers), and each namespace (a share of `max_entries` in distinct keys). Holdings
leave by eviction (a list or a namespace over its bound), by expiry (a speculative holding past its
TTL), or by removal (a KV event, a failed request, a worker cleared or gone). Recording lives in
`index.py`, lookups in `index_lookup.py`, the records in `index_types.py`.

A worker that leaves the pool is retired (`retire_worker`): forgotten, and nothing more is recorded
for it (a request still running there when it left, a KV event in flight, a peer's late dispatch)
until it joins again (`admit_worker`), which forgets whatever was known of that URL before: a
worker that joins is a process the index knows nothing of yet, whatever ran at its URL earlier.

Invariants (asserted by `check_invariants`):
1. `w in _table[k].holders` iff `k in _lru[w]`.
2. `len(_lru[w]) <= effective capacity of w`; the sum over workers is at most `max_entries`.
3. every key sits in exactly the namespace list of its entry, within that namespace's quota.
4. a speculative holding has a finite expiry, a confirmed one `inf`; `_spec_expiry` has exactly one
   record per speculative holding (so it is bounded by `max_entries`).
5. every per-worker table is keyed by members only: `_cap_blocks` has the keys of `_lru`, `_open` a
   subset of them; retired workers (`_gone`, at most `max_workers`) are not members. So memory per
   worker is bounded by `max_workers`, however many workers come and go.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from policies.base import WorkerId
from policies.index_types import CONFIRMED, Entry, IndexConfig
from policies.stats import IndexStats
from prompt_normalizer.types import BlockKey


class IndexHoldings:
    """Block key → holders and each worker's LRU list, with capacities, namespace quotas and the
    speculative holdings' expiry order; sizing, eviction, expiry and removal."""

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
        # Workers retired from the pool (`retire_worker`), the latest last, until they join again.
        self._gone: OrderedDict[WorkerId, None] = OrderedDict()
        self._evictions = 0
        self._expirations = 0

    # -- sizing -------------------------------------------------------------------------------

    def share_by(self, namespace_share: Callable[[str], float]) -> None:
        """Size each namespace's part by `namespace_share` from now on (a reloaded policy's)."""
        self._share = namespace_share

    def _blocks_for_tokens(self, tokens: int) -> int:
        return max(0, tokens // (self.block_size_tokens * self._g))

    def set_capacity(self, worker: WorkerId, capacity_tokens: int) -> None:
        """Set how many tokens of prefix cache `worker` has (e.g. `num_gpu_blocks × block_size`)."""
        blocks = self._blocks_for_tokens(capacity_tokens)
        if self._cap_blocks.get(worker) == blocks and worker in self._lru:
            return
        if not self._ensure_worker(worker):
            return
        self._cap_blocks[worker] = blocks
        self._trim(worker)

    def _ensure_worker(self, worker: WorkerId) -> bool:
        """Make `worker` a member (a list and a capacity); False for a retired worker, which stays out."""
        if worker in self._lru:
            return True
        if worker in self._gone:
            return False
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
        return True

    def capacity_blocks(self, worker: WorkerId) -> int:
        """The effective capacity: the worker's own, capped by its even share of `max_entries`."""
        own = self._cap_blocks.get(worker)
        if own is None:
            own = self._blocks_for_tokens(self.config.default_capacity_tokens)
        return min(own, self.config.max_entries // max(1, len(self._lru)))

    def _namespace_quota(self, namespace: str) -> int:
        return max(1, int(self.config.max_entries * self._share(namespace)))

    # -- removal and expiry ----------------------------------------------------------------

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
        """Drop every holding of `worker` but keep its capacity (vLLM `AllBlocksCleared`, or a
        worker that may have restarted)."""
        cap = self._cap_blocks.get(worker)
        self.forget_worker(worker)
        if cap is not None and self._ensure_worker(worker):
            self._cap_blocks[worker] = cap

    def retire_worker(self, worker: WorkerId) -> None:
        """`worker` left the pool: forget it, and record nothing of it until `admit_worker`."""
        self.forget_worker(worker)
        gone = self._gone
        gone[worker] = None
        gone.move_to_end(worker)
        if len(gone) > self.config.max_workers:
            gone.popitem(last=False)

    def retired(self, worker: WorkerId) -> bool:
        """Whether `worker` left the pool (and has not joined again)."""
        return worker in self._gone

    def admit_worker(self, worker: WorkerId) -> None:
        """`worker` joined the pool: what was known of its URL before is about another process."""
        self._gone.pop(worker, None)
        self.forget_worker(worker)

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
        assert self._cap_blocks.keys() == self._lru.keys(), "capacity of a worker that is no member"
        assert self._open.keys() <= self._lru.keys(), "open mark of a worker that is no member"
        assert not self._gone.keys() & self._lru.keys(), "a retired worker is a member"
        assert len(self._gone) <= self.config.max_workers, "retired workers over max_workers"
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
