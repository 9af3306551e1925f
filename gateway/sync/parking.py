"""Peers' holdings on a worker this gateway has not discovered yet, kept until it has (briefly).

Two gateways that discover workers through Kubernetes or DNS see a new worker at different moments.
What the quicker one routes to it in between would otherwise be lost here for good (the receiver
drops holdings of workers not in its registry, since a name costs a third party nothing to make
up), and the slower gateway would route the new worker's first prefixes as misses. So a holding of
an unknown worker of a *known* pool is parked, and applied when discovery adds the worker.

Parking is bounded so that made-up workers cost a small fixed amount whatever a sender names:
at most `MAX_HOLDINGS` holdings and `MAX_KEYS` keys in all, `MAX_ORIGIN_HOLDINGS` holdings and
`MAX_ORIGIN_KEYS` keys per sender. Beyond either, the oldest of that sender, then the oldest of
all, makes room, as does a newer holding of the same ref (counted as evicted); a holding waits at
most `ttl_s`, a few discovery intervals (then counted as expired). The outcome of a parked
holding stays with it: a served one is applied after the holding, a failed one withdraws it.
Invariant (`check_invariants`): the per-sender, per-worker and key counts are those of the parked
holdings, within the bounds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from policies.base import WorkerId
from policies.peer_sync import PeerHolding

_Ref = tuple[str, int]  # (origin, the holding's ref)
_Slot = tuple[str, WorkerId]  # (pool, worker)


@dataclass(slots=True)
class Parked:
    """One parked holding: its sender, when it was parked (this gateway's monotonic clock) and
    whether its request was served (None: no outcome heard yet)."""

    origin: str
    holding: PeerHolding
    parked_s: float
    served: bool | None = None


@dataclass(slots=True)
class ParkingStats:
    """Monotonic counts for the metrics. parked = applied + expired + evicted + withdrawn + held."""

    parked: int = 0
    applied: int = 0  # the worker was discovered: applied to the policy
    expired: int = 0  # not discovered within the TTL
    evicted: int = 0  # made room for a newer one (the bounds)
    withdrawn: int = 0  # its request failed before the worker was discovered


class ParkedHoldings:
    """Holdings waiting for their worker to be discovered, oldest first (see the module)."""

    MAX_HOLDINGS = 1024
    MAX_KEYS = 65_536
    MAX_ORIGIN_HOLDINGS = 256
    MAX_ORIGIN_KEYS = 16_384  # one holding of the longest chain applied (`MAX_HOLDING_KEYS`)

    __slots__ = ("_all", "_by_origin", "_keys", "_origin_keys", "_slots", "stats", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_s = ttl_s
        self._all: OrderedDict[_Ref, Parked] = OrderedDict()
        self._by_origin: dict[str, OrderedDict[int, None]] = {}
        self._origin_keys: dict[str, int] = {}
        self._slots: dict[_Slot, int] = {}  # parked holdings per worker
        self._keys = 0
        self.stats = ParkingStats()

    def __len__(self) -> int:
        return len(self._all)

    @property
    def keys(self) -> int:
        return self._keys

    def get(self, origin: str, ref: int) -> Parked | None:
        return self._all.get((origin, ref))

    def slots(self) -> list[_Slot]:
        """The (pool, worker) pairs something waits for (at most `MAX_HOLDINGS`)."""
        return list(self._slots)

    def park(self, origin: str, holding: PeerHolding, now_s: float) -> None:
        """Keep `holding` (at most `MAX_ORIGIN_KEYS` keys: the subscriber cuts it first) until its
        worker is discovered, it expires or it is pushed out; a ref seen again replaces it."""
        if len(holding.keys) > self.MAX_ORIGIN_KEYS:
            raise ValueError("a parked holding is cut to MAX_ORIGIN_KEYS first")
        if (origin, holding.ref) in self._all:
            self._remove((origin, holding.ref))
            self.stats.evicted += 1
        mine = self._by_origin.get(origin)
        n = len(holding.keys)
        while mine and (
            len(mine) >= self.MAX_ORIGIN_HOLDINGS or self._origin_keys[origin] + n > self.MAX_ORIGIN_KEYS
        ):
            self._remove((origin, next(iter(mine))))
            self.stats.evicted += 1
            mine = self._by_origin.get(origin)
        while self._all and (len(self._all) >= self.MAX_HOLDINGS or self._keys + n > self.MAX_KEYS):
            self._remove(next(iter(self._all)))
            self.stats.evicted += 1
        self._all[(origin, holding.ref)] = Parked(origin, holding, now_s)
        self._by_origin.setdefault(origin, OrderedDict())[holding.ref] = None
        self._origin_keys[origin] = self._origin_keys.get(origin, 0) + n
        slot = (holding.pool, holding.worker)
        self._slots[slot] = self._slots.get(slot, 0) + 1
        self._keys += n
        self.stats.parked += 1

    def settle(self, origin: str, ref: int, served: bool) -> bool:
        """A peer's outcome: True when it belongs to a parked holding (then kept with it, or the
        holding withdrawn if its request failed) rather than to one the policy has."""
        found = self._all.get((origin, ref))
        if found is None:
            return False
        if served:
            found.served = True
        else:
            self._remove((origin, ref))
            self.stats.withdrawn += 1
        return True

    def take(self, known: Callable[[str, WorkerId], bool]) -> list[Parked]:
        """Remove and return, oldest first, the holdings whose worker is now `known`."""
        found = {slot for slot in self._slots if known(*slot)}
        if not found:
            return []
        taken = [p for p in self._all.values() if (p.holding.pool, p.holding.worker) in found]
        for p in taken:
            self._remove((p.origin, p.holding.ref))
        self.stats.applied += len(taken)
        return taken

    def expire(self, now_s: float) -> None:
        """Forget holdings parked `ttl_s` ago or earlier (they are in the order parked)."""
        while self._all:
            ref, oldest = next(iter(self._all.items()))
            if now_s - oldest.parked_s < self.ttl_s:
                return
            self._remove(ref)
            self.stats.expired += 1

    def _remove(self, ref: _Ref) -> None:
        found = self._all.pop(ref, None)
        if found is None:
            return
        origin, n = ref[0], len(found.holding.keys)
        mine = self._by_origin[origin]
        del mine[ref[1]]
        if mine:
            self._origin_keys[origin] -= n
        else:
            del self._by_origin[origin], self._origin_keys[origin]
        slot = (found.holding.pool, found.holding.worker)
        left = self._slots[slot] - 1
        if left:
            self._slots[slot] = left
        else:
            del self._slots[slot]
        self._keys -= n

    def check_invariants(self) -> None:
        parked = self._all.values()
        assert self._keys == sum(len(p.holding.keys) for p in parked), "keys drifted"
        assert len(self._all) <= self.MAX_HOLDINGS and self._keys <= self.MAX_KEYS, "beyond the bounds"
        assert sum(len(m) for m in self._by_origin.values()) == len(self._all), "origins drifted"
        for origin, mine in self._by_origin.items():
            assert mine and len(mine) <= self.MAX_ORIGIN_HOLDINGS, "a sender beyond its bound"
            keys = sum(len(self._all[(origin, ref)].holding.keys) for ref in mine)
            assert keys == self._origin_keys[origin] <= self.MAX_ORIGIN_KEYS, "a sender's keys drifted"
        slots: dict[_Slot, int] = {}
        for p in parked:
            slot = (p.holding.pool, p.holding.worker)
            slots[slot] = slots.get(slot, 0) + 1
        assert slots == self._slots, "workers drifted"
        s = self.stats
        assert s.parked == s.applied + s.expired + s.evicted + s.withdrawn + len(self._all), "counts drifted"
