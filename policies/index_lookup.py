"""Prefix lookups over the index's key table: each worker's matched depth along one chain.

Workers whose holdings are prefix-closed are resolved by bisection: holding block i implies
holding blocks 0..i−1, so "holds block i" is monotone along the chain and a binary search finds
the first gap exactly, grouping workers that share a depth. The others (fed by KV events or
explicit removals, listed in `open_workers`) are walked block by block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.base import WorkerId
from policies.index_types import NO_MATCH, Entry, PrefixMatch
from prompt_normalizer.types import BlockKey


def lookup_prefix(
    table: Mapping[BlockKey, Entry],
    open_workers: Mapping[WorkerId, None],
    probe: Sequence[BlockKey],
    namespace: str,
    now_s: float,
    granularity: int,
) -> PrefixMatch:
    """Each worker's matched length along `probe` (the indexed keys of a request), from block 0.

    A worker's match ends at its first missing (or expired) block, never skipping a gap. A key
    filed under another namespace is a miss, so a collision can never leak across tenants.
    """
    if not probe:
        return NO_MATCH
    head = table.get(probe[0])
    if head is None or head.namespace != namespace:
        return NO_MATCH
    holders = head.holders
    if head.spec == 0 and len(holders) == 1:
        # One holder, confirmed: found without building the set below.
        (w,) = holders
        if not open_workers or w not in open_workers:
            depth = _depth(table, probe, namespace, now_s, w, 1, len(probe))
            return PrefixMatch({w: depth * granularity}, depth * granularity, w)
    alive = set(holders) if head.spec == 0 else {w for w, exp in holders.items() if exp > now_s}
    if not alive:
        return NO_MATCH
    if len(alive) == 1 and (not open_workers or not alive & open_workers.keys()):
        # One holder, prefix-closed (the common case in a small pool): its depth is the match.
        (w,) = alive
        depth = _depth(table, probe, namespace, now_s, w, 1, len(probe))
        return PrefixMatch({w: depth * granularity}, depth * granularity, w)
    depth_of: dict[WorkerId, int] = {}
    walk = alive & open_workers.keys() if open_workers else set()
    closed = alive - walk if walk else alive
    if closed:
        _bisect(table, probe, namespace, now_s, closed, depth_of)
    if walk:
        _walk(table, probe, namespace, now_s, walk, depth_of)
    longest = max(depth_of.values())
    matched = depth_of if granularity == 1 else {w: d * granularity for w, d in depth_of.items()}
    deepest: WorkerId | None = None
    for w in reversed(table[probe[longest - 1]].holders):
        if depth_of.get(w) == longest:
            deepest = w
            break
    return PrefixMatch(matched, longest * granularity, deepest)


def _live(
    table: Mapping[BlockKey, Entry], key: BlockKey, namespace: str, now_s: float, group: set[WorkerId]
) -> set[WorkerId]:
    """The members of `group` holding `key` (in `namespace`, not expired)."""
    entry = table.get(key)
    if entry is None or entry.namespace != namespace:
        return set()
    holders = entry.holders
    if entry.spec == 0:
        return group & holders.keys()
    return {w for w in group if holders.get(w, 0.0) > now_s}


def _bisect(
    table: Mapping[BlockKey, Entry],
    probe: Sequence[BlockKey],
    namespace: str,
    now_s: float,
    group: set[WorkerId],
    depth_of: dict[WorkerId, int],
) -> None:
    # Every member holds probe[0] and has its depth in [lo, hi]; split the group at mid.
    # (`_live` inlined: this loop is the lookup's hot path.)
    table_get = table.get
    stack = [(group, 1, len(probe))]
    while stack:
        members, lo, hi = stack.pop()
        if len(members) == 1:
            (w,) = members
            depth_of[w] = _depth(table, probe, namespace, now_s, w, lo, hi)
            continue
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


def _depth(
    table: Mapping[BlockKey, Entry],
    probe: Sequence[BlockKey],
    namespace: str,
    now_s: float,
    w: WorkerId,
    lo: int,
    hi: int,
) -> int:
    """One worker's depth along `probe`, known to be in [lo, hi]: plain binary search on its own
    holdings (no set algebra)."""
    table_get = table.get
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        entry = table_get(probe[mid - 1])
        if entry is not None and entry.namespace == namespace and entry.holders.get(w, 0.0) > now_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _walk(
    table: Mapping[BlockKey, Entry],
    probe: Sequence[BlockKey],
    namespace: str,
    now_s: float,
    alive: set[WorkerId],
    depth_of: dict[WorkerId, int],
) -> None:
    depth = 1
    for key in probe[1:]:
        still = _live(table, key, namespace, now_s, alive)
        for w in alive - still:
            depth_of[w] = depth
        alive = still
        if not alive:
            return
        depth += 1
    for w in alive:
        depth_of[w] = depth
