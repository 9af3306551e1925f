"""The bounds on client connections (`ClientLimits`, from the config's `limits`) and the guard
that enforces their deadlines (`ClientGuard`): the connections waiting on their client, checked on
uvicorn's periodic tick, and the count of what was refused. The connections themselves are
`http_limits.GuardedHttpToolsProtocol`; the module docstring there describes the phases and
deadlines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from uvicorn.server import ServerState

from gateway.config import LimitsConfig
from gateway.metrics.families import HotCounter


class Guarded(Protocol):
    """A connection as the guard sees it: its deadlines, and what it does when one passes."""

    deadline_s: float  # of its phase, while in `ClientGuard.waiting`
    send_deadline_s: float  # while in `ClientGuard.stalled`

    def expire(self) -> None: ...

    def expire_send(self) -> None: ...


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


class ClientGuard:
    """The connections waiting on a client (with a deadline), checked on each periodic tick, and a
    count of what was refused, by reason (`kvgate_client_refusals_total`).

    Invariants: a connection is in `waiting` exactly when its phase is not APP and it is open;
    in `stalled` exactly when it is open and its writes are paused (its client is not reading),
    or it was closed with answers still buffered (a close waits for them to be sent, and a buffer
    below the high-water mark never pauses the writes).
    """

    def __init__(self, limits: ClientLimits, refusals: HotCounter) -> None:
        self.limits = limits
        self.waiting: set[Guarded] = set()
        self.stalled: set[Guarded] = set()
        # Open capped connections per client address, while `max_connections_per_address` is set.
        self.by_address: dict[str, int] = {}
        self._refusals = refusals
        self._next_check_s = 0.0

    def refused(self, reason: str) -> None:
        self._refusals.labels(reason).inc()

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


class GuardedServerState(ServerState):
    """uvicorn's state shared by all connections of a server, plus the `ClientGuard`."""

    def __init__(self, guard: ClientGuard) -> None:
        super().__init__()
        self.guard = guard
