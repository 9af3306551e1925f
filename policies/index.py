"""Per-pool prefix index: which workers (probably) hold which chained block keys.

A block key identifies a whole prefix (keys are chained), so the index is a radix tree flattened
into a dict. Each worker has a capacity in index blocks and its own LRU list (block → last use);
when the list is full the oldest block is dropped, so the index forgets what the worker must have
evicted. A request's blocks are touched last-to-first, which leaves block 0 the most recent: like
vLLM's free queue, the tail of a chain goes before its head.

Holdings learned from our own routing are speculative (they expire after a short TTL) until a
completed request or a KV event confirms them. Memory is bounded three ways: each worker's list,
the whole pool (`max_entries` holdings, split evenly across workers), and each namespace (a share
of `max_entries` in distinct keys).

Invariants (asserted by `check_invariants`):
1. `w in _table[k].holders` iff `k in _lru[w]`.
2. `len(_lru[w]) <= effective capacity of w`; the sum over workers is at most `max_entries`.
3. every key sits in exactly the namespace list of its entry, within that namespace's quota.
4. a speculative holding has a finite expiry, a confirmed one `inf`; `_speculative` counts the former.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from policies.base import WorkerId
from policies.stats import IndexStats
from prompt_normalizer.types import BlockKey

CONFIRMED = math.inf


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Sizing of one pool's index. Capacities are in tokens, converted to index blocks per pool."""

    default_capacity_tokens: int = 430_000
    max_entries: int = 4_000_000
    namespace_share: float = 0.5
    speculative_ttl_s: float = 60.0
    granularity_blocks: int = 1
    max_workers: int = 1024

    def __post_init__(self) -> None:
        if self.granularity_blocks < 1:
            raise ValueError("granularity_blocks must be >= 1")
        if self.max_entries < 1 or self.default_capacity_tokens < 0:
            raise ValueError("max_entries must be >= 1 and default_capacity_tokens >= 0")
        if not 0.0 < self.namespace_share <= 1.0:
            raise ValueError("namespace_share must be in (0, 1]")
        if self.speculative_ttl_s <= 0:
            raise ValueError("speculative_ttl_s must be > 0")


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Every worker's matched prefix for one request, in request blocks (only workers with a match).

    `deepest_holder` is the most recent holder of the deepest matched block (SGLang's `last_tenant`).
    """

    blocks_by_worker: Mapping[WorkerId, int] = field(default_factory=dict)
    longest_blocks: int = 0
    deepest_holder: WorkerId | None = None

    def blocks(self, worker: WorkerId) -> int:
        return self.blocks_by_worker.get(worker, 0)


NO_MATCH = PrefixMatch()


class _Entry:
    """One block key: its namespace and holders (worker → expiry; insertion order = recency)."""

    __slots__ = ("holders", "namespace", "spec")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.holders: dict[WorkerId, float] = {}
        self.spec = 0  # speculative holders, so lookups know when expiry must be checked


_namespace_of = operator.attrgetter("namespace")


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
        self._table: dict[BlockKey, _Entry] = {}
        # Per worker: block key → last use (seconds), in recency order.
        self._lru: dict[WorkerId, OrderedDict[BlockKey, float]] = {}
        self._cap_blocks: dict[WorkerId, int] = {}
        self._ns_keys: dict[str, OrderedDict[BlockKey, None]] = {}
        self._spec_queue: deque[tuple[float, WorkerId, BlockKey]] = deque()
        # Workers whose holdings may not be prefix-closed (a KV-event insert or removal, or a
        # collision, happened since their last clear); lookups walk them block by block.
        self._open: dict[WorkerId, None] = {}
        self._speculative = 0
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
        # A new worker lowers everyone's share of the pool bound.
        for w in list(self._lru):
            self._trim(w)

    def capacity_blocks(self, worker: WorkerId) -> int:
        """The effective capacity: the worker's own, capped by its even share of `max_entries`."""
        own = self._cap_blocks.get(worker, self._blocks_for_tokens(self.config.default_capacity_tokens))
        return min(own, self.config.max_entries // max(1, len(self._lru)))

    def _namespace_quota(self, namespace: str) -> int:
        return max(1, int(self.config.max_entries * self._share(namespace)))

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], namespace: str, now_s: float) -> PrefixMatch:
        """Each worker's matched length for `keys`, walking from block 0: a worker's match ends at
        its first missing (or expired) block, never skipping a gap. A key filed under another
        namespace is a miss, so a collision can never leak across tenants.

        Workers whose holdings are prefix-closed (see `_open`) are resolved by bisection: holding
        block i implies holding blocks 0..i−1, so "holds block i" is monotone along the chain and a
        binary search finds the first gap exactly, grouping workers that share a depth. The others
        (fed by KV events or explicit removals) are walked block by block.
        """
        g = self._g
        probe = keys if g == 1 else keys[g - 1 :: g]
        if not probe:
            return NO_MATCH
        table = self._table
        head = table.get(probe[0])
        if head is None or head.namespace != namespace:
            return NO_MATCH
        alive = {w for w, exp in head.holders.items() if exp > now_s}
        if not alive:
            return NO_MATCH
        depth_of: dict[WorkerId, int] = {}
        walk = alive & self._open.keys() if self._open else set()
        closed = alive - walk if walk else alive
        if closed:
            self._bisect(probe, namespace, now_s, closed, depth_of)
        if walk:
            self._walk(probe, namespace, now_s, walk, depth_of)
        longest = max(depth_of.values())
        matched = {w: d * g for w, d in depth_of.items()}
        deepest: WorkerId | None = None
        entry = table[probe[longest - 1]]
        for w in reversed(entry.holders):
            if depth_of.get(w) == longest:
                deepest = w
                break
        return PrefixMatch(matched, longest * g, deepest)

    def _live(self, key: BlockKey, namespace: str, now_s: float, group: set[WorkerId]) -> set[WorkerId]:
        """The members of `group` holding `key` (in `namespace`, not expired)."""
        entry = self._table.get(key)
        if entry is None or entry.namespace != namespace:
            return set()
        holders = entry.holders
        if entry.spec == 0:
            return group & holders.keys()
        return {w for w in group if holders.get(w, 0.0) > now_s}

    def _bisect(
        self,
        probe: Sequence[BlockKey],
        namespace: str,
        now_s: float,
        group: set[WorkerId],
        depth_of: dict[WorkerId, int],
    ) -> None:
        # Every member holds probe[0] and has its depth in [lo, hi]; split the group at mid.
        # (`_live` inlined: this loop is the lookup's hot path.)
        table_get = self._table.get
        stack = [(group, 1, len(probe))]
        while stack:
            members, lo, hi = stack.pop()
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                entry = table_get(probe[mid - 1])
                if entry is None or entry.namespace != namespace:
                    hi = mid - 1
                    continue
                holders = entry.holders
                if entry.spec == 0:
                    if holders.keys() >= members:
                        lo = mid
                        continue
                    deeper = members & holders.keys()
                else:
                    deeper = {w for w in members if holders.get(w, 0.0) > now_s}
                if not deeper:
                    hi = mid - 1
                elif len(deeper) == len(members):
                    lo = mid
                else:
                    stack.append((members - deeper, lo, mid - 1))
                    members, lo = deeper, mid
            for w in members:
                depth_of[w] = lo

    def _walk(
        self,
        probe: Sequence[BlockKey],
        namespace: str,
        now_s: float,
        alive: set[WorkerId],
        depth_of: dict[WorkerId, int],
    ) -> None:
        depth = 1
        for key in probe[1:]:
            still = self._live(key, namespace, now_s, alive)
            for w in alive - still:
                depth_of[w] = depth
            alive = still
            if not alive:
                return
            depth += 1
        for w in alive:
            depth_of[w] = depth

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
    ) -> None:
        """Note that `worker` holds the first `n_blocks` of `keys` (all by default).

        A speculative holding never downgrades a confirmed one; a confirmed one clears the TTL.
        """
        self._ensure_worker(worker)
        end = len(keys) if n_blocks is None else min(n_blocks, len(keys))
        g = self._g
        last = (end // g) * g - 1
        if last < 0:
            return
        lru = self._lru[worker]
        ns_keys = self._ns_keys.get(namespace)
        if ns_keys is None:
            ns_keys = self._ns_keys[namespace] = OrderedDict()
        expiry = now_s + self.config.speculative_ttl_s if speculative else CONFIRMED
        # Last block first, so block 0 ends up the most recently used.
        for idx in range(last, -1, -g):
            self._touch(keys[idx], worker, namespace, expiry, now_s, lru, ns_keys)
        self._trim(worker)
        self._trim_namespace(namespace)
        self._bound_queue()

    def record_key(self, key: BlockKey, worker: WorkerId, namespace: str, now_s: float) -> None:
        """Confirm one holding, ignoring granularity (the caller placed it: KV events know depths)."""
        self._ensure_worker(worker)
        self._open[worker] = None
        ns_keys = self._ns_keys.get(namespace)
        if ns_keys is None:
            ns_keys = self._ns_keys[namespace] = OrderedDict()
        self._touch(key, worker, namespace, CONFIRMED, now_s, self._lru[worker], ns_keys)
        self._trim(worker)
        self._trim_namespace(namespace)

    def _touch(
        self,
        key: BlockKey,
        worker: WorkerId,
        namespace: str,
        expiry: float,
        now_s: float,
        lru: OrderedDict[BlockKey, float],
        ns_keys: OrderedDict[BlockKey, None],
    ) -> None:
        entry = self._table.get(key)
        if entry is None:
            entry = self._table[key] = _Entry(namespace)
        elif entry.namespace != namespace:
            self._open[worker] = None
            return  # a 64-bit collision across namespaces: keep the first owner, never share
        holders = entry.holders
        old = holders.pop(worker, None)
        speculative = expiry != CONFIRMED
        if old is None:
            new = expiry
            if speculative:
                self._speculative += 1
                entry.spec += 1
        elif old == CONFIRMED:
            new = CONFIRMED
        elif speculative:
            new = max(old, expiry)
        else:
            new = CONFIRMED
            self._speculative -= 1
            entry.spec -= 1
        holders[worker] = new
        if speculative and new != CONFIRMED and new != old:
            self._spec_queue.append((new, worker, key))
        if old is None:
            lru[key] = now_s
        else:
            lru.move_to_end(key)
            lru[key] = now_s
        if key in ns_keys:
            ns_keys.move_to_end(key)
        else:
            ns_keys[key] = None

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
        """Drop speculative holdings whose TTL has passed. Amortized O(1) per holding."""
        queue = self._spec_queue
        while queue and queue[0][0] <= now_s:
            self._expire_one(*queue.popleft())

    def _expire_one(self, expiry: float, worker: WorkerId, key: BlockKey) -> None:
        entry = self._table.get(key)
        if entry is None or entry.holders.get(worker) != expiry:
            return  # refreshed, confirmed or already gone
        self._lru[worker].pop(key, None)
        self._drop_holding(key, entry, worker)
        self._expirations += 1

    def _bound_queue(self) -> None:
        # The expiry queue gets one record per refresh; cap it so a refresh storm stays bounded.
        queue = self._spec_queue
        while len(queue) > 2 * self.config.max_entries:
            self._expire_one(*queue.popleft())

    def _drop_holding(self, key: BlockKey, entry: _Entry, worker: WorkerId) -> None:
        exp = entry.holders.pop(worker)
        if exp != CONFIRMED:
            self._speculative -= 1
            entry.spec -= 1
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
            speculative_entries=self._speculative,
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
                    speculative += 1
        assert speculative == self._speculative, "speculative counter drifted"
        for ns, keys in self._ns_keys.items():
            assert len(keys) == ns_seen.get(ns, 0), f"namespace {ns} list drifted"
            assert len(keys) <= self._namespace_quota(ns), f"namespace {ns} over quota"
