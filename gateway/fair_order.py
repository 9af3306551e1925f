"""The order in which a pool's waiting requests get a worker: fair across tenants, best first
within one tenant.

Across tenants it is self-clocked fair queueing (Golestani, 1994), with the tenant's next turn
tagged rather than each request (so that a tenant's own priorities can reorder its requests):

    V = the tag of the turn served last (never decreases)
    a tenant with nothing waiting gets its first request:  tag = V + 1 / weight
    serve the tenant with the smallest tag (ties: the one that was tagged first), then
        V = its tag;  if it still has requests waiting: tag = V + 1 / weight

A tenant that floods only pushes its own tags further out; one that was idle starts at V and so
cannot bank credit while idle; with every tenant waiting, tenant i gets `weight_i / Σ weight` of
the turns. Within a tenant, requests go by vLLM's `priority` (lower first), then by arrival.

The structure is pure (no clock, no I/O) and every step is O(log n): a heap of the tenants
that have requests waiting, and one heap of requests per tenant. A request that leaves before
its turn (its client went away, it timed out) is only marked; it is skipped when it surfaces,
and a tenant's heap is rebuilt when it holds more dead entries than live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Entry(Generic[T]):
    """One waiting item; `live` is False once it was served or removed."""

    tenant: str
    priority: int
    seq: int
    item: T
    live: bool = True

    def __lt__(self, other: Entry[T]) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


@dataclass(slots=True, eq=False)
class _Tenant(Generic[T]):
    """A tenant with at least one live entry. Invariant: `live` counts the live entries of `heap`,
    and exactly one turn in the order's heap of turns names this object (its next turn)."""

    name: str
    weight: float
    tag: float = 0.0
    live: int = 0
    heap: list[Entry[T]] = field(default_factory=list)


class FairOrder(Generic[T]):
    """Waiting items of many tenants in weighted fair order (see the module docstring)."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant[T]] = {}
        # (tag, tie, tenant): `tie` is unique, so a tenant object is never compared.
        self._turns: list[tuple[float, int, _Tenant[T]]] = []
        self._virtual = 0.0
        self._seq = itertools.count()
        self._tie = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def depth(self, tenant: str) -> int:
        """Live items of one tenant."""
        t = self._tenants.get(tenant)
        return t.live if t is not None else 0

    def depths(self) -> Iterator[tuple[str, int]]:
        """(tenant, live items) of every tenant with something waiting."""
        return ((t.name, t.live) for t in self._tenants.values())

    def push(self, tenant: str, weight: float, priority: int, item: T) -> Entry[T]:
        """Add an item; `weight` (> 0) is the tenant's share, read when the tenant gets a turn."""
        return self.restore(Entry(tenant, priority, next(self._seq), item), weight)

    def restore(self, entry: Entry[T], weight: float) -> Entry[T]:
        """Put back an item that was popped but could not be served, in its old place within
        its tenant (same priority and arrival)."""
        t = self._tenants.get(entry.tenant)
        if t is None:
            t = self._tenants[entry.tenant] = _Tenant(entry.tenant, weight)
            t.tag = self._virtual + 1.0 / weight
            heapq.heappush(self._turns, (t.tag, next(self._tie), t))
        entry.live = True
        heapq.heappush(t.heap, entry)
        t.live += 1
        self._live += 1
        return entry

    def remove(self, entry: Entry[T]) -> None:
        """Take out an item before its turn (a no-op if it was already served or removed)."""
        if not entry.live:
            return
        entry.live = False
        self._live -= 1
        t = self._tenants[entry.tenant]
        t.live -= 1
        if t.live == 0:
            self._drop(t)
        elif len(t.heap) > 2 * t.live:
            t.heap = [e for e in t.heap if e.live]
            heapq.heapify(t.heap)

    def pop(self) -> Entry[T] | None:
        """The next item in fair order, or None when nothing waits."""
        while self._turns:
            tag, _, t = heapq.heappop(self._turns)
            if self._tenants.get(t.name) is not t:
                continue  # the turn of a tenant whose items all left (it may have come back since)
            entry = heapq.heappop(t.heap)
            while not entry.live:
                entry = heapq.heappop(t.heap)
            entry.live = False
            self._live -= 1
            t.live -= 1
            self._virtual = tag
            if t.live == 0:
                self._drop(t)
            else:
                t.tag = tag + 1.0 / t.weight
                heapq.heappush(self._turns, (t.tag, next(self._tie), t))
            return entry
        return None

    def _drop(self, t: _Tenant[T]) -> None:
        # Its turn left in `_turns` no longer matches a tenant: skipped when it surfaces, and
        # swept out when such turns outnumber the current ones.
        del self._tenants[t.name]
        if len(self._turns) > 2 * len(self._tenants) + 64 or not self._tenants:
            self._turns = [turn for turn in self._turns if self._tenants.get(turn[2].name) is turn[2]]
            heapq.heapify(self._turns)

    def check_invariants(self) -> None:
        """Counters agree with the heaps; every tenant kept has live items and one current turn."""
        assert self._live == sum(t.live for t in self._tenants.values())
        for t in self._tenants.values():
            assert t.live > 0 and t.live == sum(1 for e in t.heap if e.live)
            assert sum(1 for turn in self._turns if turn[2] is t) == 1
