"""The bounds on client connections (`ClientLimits`, from the config's `limits`) and the guard
that enforces their deadlines (`ClientGuard`): the connections waiting on their client, checked on
uvicorn's periodic tick, the connections a full table may close for a new one (`Evictable`), and
the count of what was refused. The connections themselves are `http_limits.GuardedHttpToolsProtocol`;
the module docstring there describes the phases and deadlines."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from uvicorn.server import ServerState

from gateway.config import LimitsConfig
from gateway.metrics.families import HotCounter


class Guarded(Protocol):
    """A connection as the guard sees it: its deadlines, and what it does when one passes."""

    deadline_s: float  # of its phase, while in `ClientGuard.waiting`
    send_deadline_s: float  # while in `ClientGuard.stalled`

    capped: bool  # a client connection (not the metrics listener's)

    def expire(self) -> None: ...

    def expire_send(self) -> None: ...

    def evict_stalled(self) -> None: ...

    def evict(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """The per-connection bounds, from the config's `limits` section."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    max_connections: int
    send_timeout_s: float = 60.0
    max_connections_per_address: int = 0  # 0: no limit

    @classmethod
    def of(cls, limits: LimitsConfig) -> ClientLimits:
        return cls(
            limits.max_header_bytes,
            limits.max_headers,
            limits.header_timeout_s,
            limits.body_timeout_s,
            limits.keepalive_timeout_s,
            limits.max_client_connections,
            limits.send_timeout_s,
            limits.max_client_connections_per_address,
        )

    @property
    def check_interval_s(self) -> float:
        """How often deadlines are checked: a tenth of the shortest timeout, within [0.1, 1] s, so
        a connection is closed at most that long after its deadline."""
        shortest = min(
            self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s, self.send_timeout_s
        )
        return min(1.0, max(0.1, shortest / 10))


class Evictable:
    """The capped connections holding a place without a request in the app, by client address:
    idle between requests, still sending a request line and headers, still sending the body of a
    request already answered, or lingering after their last answer. A full table closes one of
    them for a new connection (`pop`): from the address holding the most, the one that has been
    evictable longest there. So a flood from one address displaces its own connections, not other
    clients'. Among addresses holding as many, the one that has held that many longest (an
    address that just gave one up or took one goes after the others).

    Every operation is O(1): an ordered set of connections per address (oldest first), the
    addresses grouped by how many they hold (each group ordered by arrival), and the largest such
    count. It holds at most the process's open connections, and a group (empty or not) for each
    count up to the most one address has held: an address's count goes up and down by one on
    every request, and a group made and dropped each time costs more than the rest.

    Invariants (`check_invariants`): no address's set is empty; an address is in the group of `n`
    exactly when it holds `n`; `_most` is the largest `n` whose group is not empty (0 if none).
    """

    def __init__(self) -> None:
        self._by_address: dict[str, OrderedDict[Guarded, None]] = {}
        self._by_count: dict[int, OrderedDict[str, None]] = {}
        self._most = 0

    def __bool__(self) -> bool:
        return bool(self._by_address)

    def held_by(self, address: str) -> int:
        held = self._by_address.get(address)
        return len(held) if held is not None else 0

    def add(self, conn: Guarded, address: str) -> None:
        """`conn` (from `address`) no longer has a request in the app; no change if it is here."""
        held = self._by_address.get(address)
        if held is None:
            held = self._by_address[address] = OrderedDict()
        elif conn in held:
            return
        held[conn] = None
        self._regroup(address, len(held) - 1, len(held))

    def discard(self, conn: Guarded, address: str) -> None:
        """`conn` has a request in the app, or is closing; no change if it is not here."""
        held = self._by_address.get(address)
        if held is not None and conn in held:
            del held[conn]
            self._left(address, held)

    def pop(self) -> Guarded | None:
        """Take out the connection to close for a new one (see the class docstring); None when
        every place is held by a request in the app."""
        if not self._most:
            return None
        address = next(iter(self._by_count[self._most]))
        held = self._by_address[address]
        conn, _ = held.popitem(last=False)
        self._left(address, held)
        return conn

    def _left(self, address: str, held: OrderedDict[Guarded, None]) -> None:
        if not held:
            del self._by_address[address]
        self._regroup(address, len(held) + 1, len(held))

    def _regroup(self, address: str, before: int, after: int) -> None:
        """Move `address` from the group of `before` to that of `after` (one more or one fewer)."""
        if before:
            left = self._by_count[before]
            del left[address]
            if not left and self._most == before:
                self._most = after  # the group `after` has `address` now, or is 0: none left
        if after:
            joined = self._by_count.get(after)
            if joined is None:
                joined = self._by_count[after] = OrderedDict()
            joined[address] = None
            if after > self._most:
                self._most = after

    def check_invariants(self) -> None:
        counts = {address: len(held) for address, held in self._by_address.items()}
        assert all(counts.values())
        groups = {address: n for n, group in self._by_count.items() for address in group}
        assert groups == counts
        assert self._most == max((n for n, group in self._by_count.items() if group), default=0)


class ClientGuard:
    """The connections waiting on a client (with a deadline), checked on each periodic tick; the
    capped connections a full table may close for a new one (`evictable`); and a count of what
    was refused, by reason (`kvgate_client_refusals_total`).

    Invariants: a connection is in `waiting` exactly when its phase is not APP and it is open;
    in `stalled` exactly when it is open and its writes are paused (its client is not reading),
    or it was closed with answers still buffered (a close waits for them to be sent, and a buffer
    below the high-water mark never pauses the writes); in `evictable` exactly when it is capped,
    open, not closing, and no request of it is in the app (parsed and not answered): not ending,
    or lingering.
    """

    def __init__(self, limits: ClientLimits, refusals: HotCounter) -> None:
        self.limits = limits
        self.waiting: set[Guarded] = set()
        self.stalled = Stalled()
        # Open capped connections per client address, while `max_connections_per_address` is set.
        self.by_address: dict[str, int] = {}
        self.evictable = Evictable()
        self._refusals = refusals
        self._next_check_s = 0.0

    def refused(self, reason: str) -> None:
        self._refusals.labels(reason).inc()

    def make_room(self) -> bool:
        """The table is full: close one evictable connection (`Evictable.pop`) so that a new one
        can take its place; with none, abort the client connection stalled longest (its client
        reads nothing of what it was sent: it would be aborted at `send_timeout_s` anyway, and
        else a client that sends requests and never reads their answers keeps its places that
        long); False when there is neither (every place has a request in the app that reads)."""
        victim = self.evictable.pop()
        if victim is not None:
            victim.evict()
            return True
        stalled = self.stalled.oldest_capped()
        if stalled is None:
            return False
        stalled.evict_stalled()
        return True

    def tick(self, now_s: float) -> None:
        """Close every connection past its deadline (at most once per `check_interval_s`)."""
        if now_s < self._next_check_s:
            return
        self._next_check_s = now_s + self.limits.check_interval_s
        for conn in [c for c in self.waiting if c.deadline_s <= now_s]:
            conn.expire()
        if self.stalled:
            for conn in [c for c in self.stalled if c.send_deadline_s <= now_s]:
                conn.expire_send()


class Stalled:
    """The connections whose client reads nothing (`ClientGuard.stalled`), in the order they
    stalled: a set whose oldest member is found without a scan."""

    __slots__ = ("_conns",)

    def __init__(self) -> None:
        self._conns: dict[Guarded, None] = {}

    def add(self, conn: Guarded) -> None:
        self._conns[conn] = None

    def discard(self, conn: Guarded) -> None:
        self._conns.pop(conn, None)

    def __contains__(self, conn: object) -> bool:
        return conn in self._conns

    def __iter__(self) -> Iterator[Guarded]:
        return iter(self._conns)

    def __len__(self) -> int:
        return len(self._conns)

    def oldest_capped(self) -> Guarded | None:
        """The client connection stalled longest (the metrics listener's few are passed over)."""
        return next((c for c in self._conns if c.capped), None)


class GuardedServerState(ServerState):
    """uvicorn's state shared by all connections of a server, plus the `ClientGuard`."""

    def __init__(self, guard: ClientGuard) -> None:
        super().__init__()
        self.guard = guard
