"""KV moving between engines (P/D disaggregation): the engine operations either side needs.

A prefill engine *holds* a finished request's prompt blocks until the decode side has read them
(vLLM keeps them allocated until the read is notified, or a timeout); a decode engine *installs*
the blocks it received into its prefix cache, where they are published as BlockStored and hit by
the request that asked for them (`EngineRequest.num_external_tokens`) and by later ones. How long
the move takes is the profile's `StepProfile.kv_transfer_s`; the caller owns the clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from loadtest.engine.block_pool import BlockPool
from loadtest.engine.types import BlocksStored, InstalledBlocks, RequestId

HoldId = Hashable
"""Any hashable caller-chosen id of a hold (e.g. the transfer's id)."""


def install_chain(pool: BlockPool, owner: RequestId, block_hashes: Sequence[int]) -> InstalledBlocks:
    """Cache the chained blocks `block_hashes` (block 0 first) as received content.

    Blocks already cached are kept (and refreshed); new ones take blank blocks or evict the least
    recently used unreferenced ones, never the chain's own. Stops at the first block with no room,
    so what is cached is always a prefix of the chain. Evictions are drained from the pool.
    """
    protected: set[int] = set()
    stored: list[BlocksStored] = []
    run_start = -1
    count = 0
    for i, h in enumerate(block_hashes):
        outcome = pool.install(h, protected)
        if outcome is None:
            break
        protected.add(h)
        count += 1
        if outcome and run_start < 0:
            run_start = i
        elif not outcome and run_start >= 0:
            stored.append(_run(owner, block_hashes, run_start, i))
            run_start = -1
    if run_start >= 0:
        stored.append(_run(owner, block_hashes, run_start, count))
    removed = tuple(pool.removed)
    pool.removed.clear()
    return InstalledBlocks(count, tuple(stored), removed)


def _run(owner: RequestId, hashes: Sequence[int], start: int, stop: int) -> BlocksStored:
    parent = hashes[start - 1] if start > 0 else None
    return BlocksStored(owner, start, tuple(hashes[start:stop]), parent)


class BlockHolds:
    """Cached blocks pinned on behalf of a transfer that has not been read yet.

    A hold references the leading cached blocks of a chain, so they can be neither evicted nor
    cleared until `release`; they count as used KV, as the held blocks of a vLLM prefill engine do.
    """

    __slots__ = ("_holds", "_pool")

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._holds: dict[HoldId, tuple[Sequence[int], int]] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, hold_id: HoldId, block_hashes: Sequence[int]) -> int:
        """Pin the leading cached blocks of `block_hashes`; returns how many were pinned."""
        if hold_id in self._holds:
            raise ValueError(f"duplicate hold id {hold_id!r}")
        hit = self._pool.lookup(block_hashes, len(block_hashes))
        self._pool.acquire(block_hashes, hit.num_blocks)
        self._holds[hold_id] = (block_hashes, hit.num_blocks)
        return hit.num_blocks

    def release(self, hold_id: HoldId) -> bool:
        """Unpin a hold's blocks (they stay cached, evictable). False if the id is unknown."""
        held = self._holds.pop(hold_id, None)
        if held is None:
            return False
        hashes, count = held
        self._pool.release(hashes, count, 0)
        return True
