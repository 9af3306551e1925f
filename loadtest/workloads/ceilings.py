"""Upper bounds on the prefix-hit ratio of a request list, whatever the router.

Both walk the requests in arrival order and match each chain from block 0, stopping at the first
miss (an engine cannot use block i without blocks 0..i-1). Hits are weighted by tokens.
- `ceiling_infinite`: one global cache that never evicts.
- `ceiling_pooled_lru`: one global LRU cache as large as the whole cluster. After each request its
  blocks are touched leaf first, so a request's root blocks are the most recently used and a chain
  is evicted from its tail, never leaving unreachable children behind (vLLM frees a request's
  blocks in the same reverse order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockChain:
    """Keys of a request's leading blocks and how many of its tokens they cover.

    Block i covers `min(block_size_tokens, keyed_tokens - i*block_size_tokens)` tokens; tokens past
    `keyed_tokens` have no key (a partial tail the source did not hash) and can never be a hit. The
    simulator's `KeyedPrompt.chain()` builds these from the production keys.
    """

    keys: tuple[int, ...]
    block_size_tokens: int
    keyed_tokens: int
    n_tokens: int

    def hit_tokens(self, n_hit_blocks: int) -> int:
        return min(n_hit_blocks * self.block_size_tokens, self.keyed_tokens)


@dataclass(frozen=True, slots=True)
class CeilingResult:
    """Token-weighted hit ratio and its parts."""

    hit_ratio: float
    hit_tokens: int
    total_tokens: int
    n_requests: int


def _result(hit: int, total: int, n: int) -> CeilingResult:
    return CeilingResult(hit / total if total else 0.0, hit, total, n)


def ceiling_infinite(chains: Iterable[BlockChain]) -> CeilingResult:
    seen: set[int] = set()
    hit = total = n = 0
    for chain in chains:
        n += 1
        total += chain.n_tokens
        keys = chain.keys
        matched = 0
        for key in keys:
            if key not in seen:
                break
            matched += 1
        hit += chain.hit_tokens(matched)
        seen.update(keys[matched:])
    return _result(hit, total, n)


def ceiling_pooled_lru(chains: Iterable[BlockChain], capacity_tokens: int) -> CeilingResult:
    """`capacity_tokens` is the cluster's total KV capacity; it holds `capacity_tokens // block` blocks
    of the chains' block size (all chains must share one block size)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = n = 0
    capacity_blocks: int | None = None
    for chain in chains:
        if capacity_blocks is None:
            capacity_blocks = max(0, capacity_tokens // chain.block_size_tokens)
        n += 1
        total += chain.n_tokens
        keys = chain.keys
        matched = 0
        for key in keys:
            if key not in lru:
                break
            matched += 1
        hit += chain.hit_tokens(matched)
        if capacity_blocks == 0:
            continue
        # Keep only what fits: a chain longer than the cache keeps its leading blocks.
        for key in reversed(keys[:capacity_blocks]):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return _result(hit, total, n)


def working_set_tokens(chains: Iterable[BlockChain]) -> int:
    """Tokens of all distinct keyed blocks (a block's size is the most tokens any request gave it)."""
    sizes: dict[int, int] = {}
    for chain in chains:
        size = chain.block_size_tokens
        last = len(chain.keys) - 1
        for i, key in enumerate(chain.keys):
            tokens = size if i < last else chain.keyed_tokens - size * last
            if sizes.get(key, 0) < tokens:
                sizes[key] = tokens
    return sum(sizes.values())
