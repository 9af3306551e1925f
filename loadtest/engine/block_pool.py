"""The prefix cache: a finite pool of KV blocks, hash → refcount, and LRU eviction.

Invariant (checked by `check_invariants`): every physical block is exactly one of
  blank      – holds nothing useful (counted, not tracked individually);
  private    – held by one request but not (yet) in the cache (partial or not-yet-full blocks);
  cached     – in `_refcount`; referenced by `_refcount[h]` requests, and in `_evictable`
               (in LRU order, oldest first) exactly when that count is 0.
so `blank + private + len(_refcount) == num_blocks`. Private blocks are counted by their owners.
Allocation takes blank blocks first, then evicts the least recently freed cached block; each
eviction is recorded for a BlockRemoved event. No operation scans the whole pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Result of a prefix lookup: how many leading blocks are cached, and how many of those are
    currently unreferenced (touching them takes them out of the evictable pool)."""

    num_blocks: int
    num_evictable: int


class BlockPool:
    """vLLM-style KV block pool with a hash-keyed prefix cache (see module docstring)."""

    __slots__ = ("_evictable", "_refcount", "blank", "num_blocks", "removed")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.blank = num_blocks
        self._refcount: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Evicted hashes not yet reported, in eviction order; the engine drains it. Consumers apply
        # a step's BlockStored events before its BlockRemoved, so a hash evicted and stored again
        # within one step leaves this list when it is stored: it ends the step cached.
        self.removed: dict[int, None] = {}

    @property
    def available(self) -> int:
        """Blocks an allocation may take: blank plus evictable cached blocks."""
        return self.blank + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._refcount)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._refcount

    def lookup(self, block_hashes: Sequence[int], max_blocks: int) -> PrefixHit:
        """Count the leading cached blocks among `block_hashes[:max_blocks]` (no state change)."""
        refcount = self._refcount
        n = 0
        evictable = 0
        limit = min(max_blocks, len(block_hashes))
        while n < limit:
            rc = refcount.get(block_hashes[n])
            if rc is None:
                break
            if rc == 0:
                evictable += 1
            n += 1
        return PrefixHit(n, evictable)

    def acquire(self, block_hashes: Sequence[int], count: int) -> None:
        """Reference the first `count` hashes, all of which must be cached (after `lookup`)."""
        refcount = self._refcount
        evictable = self._evictable
        for i in range(count):
            h = block_hashes[i]
            rc = refcount[h]
            if rc == 0:
                del evictable[h]
            refcount[h] = rc + 1

    def allocate(self, count: int) -> None:
        """Turn `count` available blocks into private blocks, evicting LRU cached blocks if needed."""
        if count > self.available:
            raise RuntimeError("allocate beyond available blocks")
        from_blank = min(count, self.blank)
        self.blank -= from_blank
        rest = count - from_blank
        if rest:
            evictable = self._evictable
            refcount = self._refcount
            removed = self.removed
            for _ in range(rest):
                h, _none = evictable.popitem(last=False)
                del refcount[h]
                removed[h] = None

    def store(self, block_hash: int) -> bool:
        """A private block just became full with content `block_hash`: cache it.

        Returns True when the hash is new (a BlockStored event). When the same content is already
        cached, the request references that copy instead and its private block becomes blank.
        """
        rc = self._refcount.get(block_hash)
        if rc is None:
            self._refcount[block_hash] = 1
            if self.removed:
                self.removed.pop(block_hash, None)
            return True
        if rc == 0:
            del self._evictable[block_hash]
        self._refcount[block_hash] = rc + 1
        self.blank += 1
        return False

    def install(self, block_hash: int, protected: set[int]) -> bool | None:
        """Cache a block whose content arrived from elsewhere, unreferenced and most recently used.

        True when newly stored, False when already cached (its LRU position is refreshed), None
        when there is no room: no blank block, and the least recently used evictable block is in
        `protected` (the caller's own chain, so every evictable block is one it just installed).
        """
        refcount = self._refcount
        evictable = self._evictable
        rc = refcount.get(block_hash)
        if rc is not None:
            if rc == 0:
                evictable.move_to_end(block_hash)
            return False
        if self.blank > 0:
            self.blank -= 1
        else:
            if not evictable:
                return None
            oldest = next(iter(evictable))
            if oldest in protected:
                return None
            del evictable[oldest]
            del refcount[oldest]
            self.removed[oldest] = None
        refcount[block_hash] = 0
        evictable[block_hash] = None
        if self.removed:
            self.removed.pop(block_hash, None)
        return True

    def release(self, block_hashes: Sequence[int], count: int, num_private: int) -> None:
        """Drop one reference on each of the first `count` hashes and free `num_private` blocks.

        Blocks are released tail first so that, among blocks freed together, the tail of the
        sequence is evicted first (as vLLM does): a later request sharing the prefix keeps it.
        """
        refcount = self._refcount
        evictable = self._evictable
        for i in range(count - 1, -1, -1):
            h = block_hashes[i]
            rc = refcount[h] - 1
            refcount[h] = rc
            if rc == 0:
                evictable[h] = None
        self.blank += num_private

    def clear(self) -> list[int] | None:
        """Forget every cached block (vLLM's reset_prefix_cache). Refused (None) while any cached
        block is referenced; otherwise returns the dropped hashes."""
        if len(self._evictable) != len(self._refcount):
            return None
        dropped = list(self._refcount)
        self.blank += len(dropped)
        self._refcount.clear()
        self._evictable.clear()
        return dropped

    def check_invariants(self, num_private: int) -> None:
        """Assert the block accounting (tests only: this one scans the pool)."""
        assert self.blank >= 0
        assert self.blank + num_private + len(self._refcount) == self.num_blocks
        zero = {h for h, rc in self._refcount.items() if rc == 0}
        assert zero == set(self._evictable)
        assert all(rc >= 0 for rc in self._refcount.values())
