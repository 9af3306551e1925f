"""Counters a policy exposes to the gateway's metrics: decisions by reason, promotions, index size.

Only counts and keyed hashes appear here, never prompt content or token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Size of one pool's prefix index."""

    keys: int
    entries: int
    speculative_entries: int
    workers: int
    keys_by_namespace: Mapping[str, int] = field(default_factory=dict)
    evictions: int = 0
    expirations: int = 0


@dataclass(frozen=True, slots=True)
class PolicyStats:
    """A snapshot of a policy's counters; `counters` are monotonic, `index` is the current size per pool."""

    policy: str
    decisions_by_reason: Mapping[str, int]
    counters: Mapping[str, int] = field(default_factory=dict)
    index: Mapping[str, IndexStats] = field(default_factory=dict)


@runtime_checkable
class SupportsStats(Protocol):
    """A policy that can report its counters (every built-in policy does)."""

    def stats(self) -> PolicyStats: ...


class DecisionCounter:
    """Counts decisions by reason; reasons are a small fixed vocabulary, so the map stays bounded."""

    __slots__ = ("_by_reason",)

    def __init__(self) -> None:
        # A plain dict: `Counter`'s `+=` costs twice a dict's get and set, once per decision.
        self._by_reason: dict[str, int] = {}

    def add(self, reason: str) -> None:
        by_reason = self._by_reason
        by_reason[reason] = by_reason.get(reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        return dict(self._by_reason)
