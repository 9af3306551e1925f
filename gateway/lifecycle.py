"""The process's lifecycle as the request path sees it: ready, draining, what is in flight.

Requests in flight are bounded by `limits.max_in_flight_requests` (the cap, C), and each tenant
by its share of it while other tenants want places too (`RequestCap`):

    share(t) = max(1, C × weight(t) / Σ weight of the tenants holding places, t included)
    a request of tenant t gets a place when
        the process holds fewer than C                  (a lone tenant may use the whole cap)
        or t holds fewer than share(t), and the process fewer than 2C

A place cannot be taken back from a request that holds it, so a tenant that arrives when another
holds the whole cap is not refused: it borrows past the cap, up to its share, the places the
tenants above their share owe, and these get no new place until the process is back under the
cap (at the cap, every tenant at or above its share is refused). So one tenant can keep no other
from its share, and past the cap only tenants below their share enter: the process holds at most
2C requests, and above C only while some tenant is over its share (or while more than C tenants
hold one place each).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from starlette.types import Receive

from gateway.disconnect import DisconnectGuard, DisconnectWatch
from gateway.errors import ApiError

log = logging.getLogger("kvgate.lifecycle")

SHUTTING_DOWN = "gateway shutting down"
# `kvgate serve --processes N` (`gateway.multiproc`): the file this process creates once it is
# ready, and, for process 0 only, the other processes' files (a JSON list: a path may hold any
# separator).
READY_FILE_ENV = "KVGATE_READY_FILE"
PEERS_READY_ENV = "KVGATE_PEERS_READY_FILES"
PROCESS_INDEX_ENV = "KVGATE_PROCESS_INDEX"  # this process's index in the group (0 to N-1)
# How often a ready process renews its file (a `utime` call: microseconds).
READY_REFRESH_S = 1.0


def held_file(ready_file: Path) -> Path:
    """The file beside a process's `ready_file` that the supervisor creates while it holds that
    process down (crash-looping past its restart budget) and removes before it starts it again."""
    return ready_file.with_name(ready_file.name + ".held")


class OpenStream(Protocol):
    """A streamed response the drain deadline can end (`streaming.ProxyStream`,
    `responses_stream.StoredResponseStream`): the client gets a terminal error event."""

    def abort(self, reason: str) -> None: ...


def shutting_down() -> ApiError:
    """What a request the drain deadline ended before its answer began is told (a retry goes to
    another replica: this one no longer listens)."""
    return ApiError(503, SHUTTING_DOWN, "server_error", "gateway_shutting_down", None, {"retry-after": "1"})


class TenantPlaces:
    """One tenant's places of a `RequestCap`. Invariant: `held >= 0`."""

    __slots__ = ("cap", "held", "weight_units")

    def __init__(self, cap: RequestCap, weight_units: int) -> None:
        self.cap = cap
        self.held = 0
        self.weight_units = weight_units

    def take(self) -> bool:
        """One more place for the tenant, or False (nothing taken) when the cap refuses it."""
        cap = self.cap
        if cap.held >= cap.capacity and not cap.lends_to(self):
            return False
        if not self.held:
            cap.active_units += self.weight_units
        self.held += 1
        cap.held += 1
        return True

    def give_back(self) -> None:
        """The end of a request that took a place."""
        self.held -= 1
        self.cap.held -= 1
        if not self.held:
            self.cap.active_units -= self.weight_units
        assert self.held >= 0, "a tenant gave back more places than it took"


class RequestCap:
    """`limits.max_in_flight_requests` and each tenant's share of it (the module docstring).
    Weights are counted in integer units (1/10,000 of a weight) so that the sum of the weights of
    the tenants holding places, kept as they come and go, is exact. Invariants: `held` is the sum
    of every tenant's `held`, and `active_units` the sum of the weight units of the tenants whose
    `held` is above 0."""

    __slots__ = ("_tenants", "_units", "active_units", "capacity", "held")

    def __init__(self, capacity: int, weights: Mapping[str, float] | None = None) -> None:
        self.capacity = capacity
        self.held = 0
        self.active_units = 0
        self._units = {name: _units(weight) for name, weight in (weights or {}).items()}
        # One per tenant that has sent a request: tenants come from the config, so this is bounded.
        self._tenants: dict[str, TenantPlaces] = {}

    def tenant(self, name: str) -> TenantPlaces:
        """The tenant's places (one dict lookup; a tenant missing from the weights weighs 1)."""
        found = self._tenants.get(name)
        if found is None:
            found = self._tenants[name] = TenantPlaces(self, self._units.get(name, _UNITS_PER_WEIGHT))
        return found

    def share(self, places: TenantPlaces) -> int:
        """The most places the tenant may hold once the process is at the cap: its weight's part
        of the cap among the tenants holding places, itself included, and at least 1."""
        active = self.active_units if places.held else self.active_units + places.weight_units
        return max(1, self.capacity * places.weight_units // active)

    def lends_to(self, places: TenantPlaces) -> bool:
        """Whether a tenant gets a place past the cap: it holds less than its share, and the
        process less than twice the cap."""
        return self.held < 2 * self.capacity and places.held < self.share(places)

    def check_invariants(self) -> None:
        assert self.held == sum(t.held for t in self._tenants.values())
        assert self.active_units == sum(t.weight_units for t in self._tenants.values() if t.held)
        assert all(t.held >= 0 for t in self._tenants.values())


_UNITS_PER_WEIGHT = 10_000


def _units(weight: float) -> int:
    return max(1, round(weight * _UNITS_PER_WEIGHT))


def _nothing() -> list[str]:
    return []


@dataclass(frozen=True, slots=True)
class ProcessGroup:
    """Readiness across the processes of `kvgate serve --processes N`. The probes ask process 0
    alone (its metrics port), while every process has its own discovery and may still be waiting
    for its first workers, answering 503 `no_worker_available` to the connections the kernel
    hands it. So each process creates a file of its own (`ready_file`) once it is ready, and renews
    it while it runs; the supervisor removes it before it starts or restarts that process; and
    process 0's `/readyz` waits for the files of the others (`peer_files`). A process the
    supervisor holds down (`held_file`) is not waited for: it has no socket, so the kernel hands
    it no connection, and the others serve (waiting for it took the whole pod out of service for
    up to the 10-minute hold). Outside a supervised group both are empty, and `index` (this
    process's, which `/admin/status` reports) is None."""

    ready_file: Path | None = None
    peer_files: tuple[Path, ...] = ()
    index: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ProcessGroup:
        own = environ.get(READY_FILE_ENV)
        peers = environ.get(PEERS_READY_ENV)
        index = environ.get(PROCESS_INDEX_ENV)
        return cls(
            Path(own) if own else None,
            tuple(Path(p) for p in json.loads(peers)) if peers else (),
            int(index) if index and index.isdigit() else None,
        )

    def peers_waiting(self) -> int:
        """How many of the other processes are not ready and not held down (a `stat` each, two
        for one that is not ready: microseconds). A process restarted within its budget is
        waited for: it is about to listen, and would answer 503 while it finds its workers."""
        return sum(1 for path in self.peer_files if not path.exists() and not held_file(path).exists())

    def peers_held(self) -> int:
        """How many of the other processes the supervisor holds down (a `stat` each)."""
        return sum(1 for path in self.peer_files if held_file(path).exists())

    async def announce(
        self, ready: Callable[[], bool], interval_s: float = 0.2, refresh_s: float = READY_REFRESH_S
    ) -> None:
        """Create `ready_file` once `ready()` holds (the process never turns unready again but
        to drain, and the whole group drains together), then renew it every `refresh_s` until
        cancelled: a cleaner of old temporary files (systemd-tmpfiles, tmpreaper) may delete it,
        and process 0 would then wait for this process for ever."""
        if self.ready_file is None:
            return
        while not ready():  # noqa: ASYNC110 - readiness is computed on demand, never signalled
            await asyncio.sleep(interval_s)
        failing = False
        while True:
            try:
                self.ready_file.touch()  # creates it again if it is gone
                failing = False
            except OSError as exc:  # process 0 will wait for this process: say why, once
                if not failing:
                    log.warning(
                        "cannot write the readiness file",
                        extra={"path": str(self.ready_file), "error": str(exc)},
                    )
                failing = True
            await asyncio.sleep(refresh_s)


@dataclass(slots=True)
class Lifecycle:
    """`started` from lifespan startup to shutdown, `draining` once shutdown begins; `ready` once
    started and `discovering()` (the pools whose first workers are not yet known, set by the app to
    the fleet's) is empty. At its
    deadline the drain (`app.drain`) ends the streams still in `active_streams` and cancels the
    requests still in `dispatching` (waiting on a worker, or for a queue's turn);
    `requests` holds the proxied requests from the end of their body to their last byte (the
    gateway-wide cap, set by the app from `limits.max_in_flight_requests`). Invariant: `ended`
    holds only tasks of `dispatching` that the deadline cancelled and that have not yet taken
    their cancellation back (`ended_by_drain`). `group` is the other processes of a
    `--processes` group that `/readyz` waits for (`ProcessGroup`), set by the app."""

    draining: bool = False
    started: bool = False
    discovering: Callable[[], list[str]] = _nothing
    requests: RequestCap | None = None
    disconnects: DisconnectWatch = field(default_factory=DisconnectWatch)
    active_streams: set[OpenStream] = field(default_factory=set)
    dispatching: set[asyncio.Task[Any]] = field(default_factory=set)
    ended: set[asyncio.Task[Any]] = field(default_factory=set)
    past_deadline: bool = False
    group: ProcessGroup = field(default_factory=ProcessGroup)

    @property
    def ready(self) -> bool:
        """Started, and every pool's first set of workers known (what `/readyz` answers 200 to)."""
        return self.started and not self.discovering()

    @property
    def in_flight_requests(self) -> int:
        """Proxied requests past their body and before their last byte, across tenants."""
        return self.requests.held if self.requests is not None else 0

    def stream_started(self, stream: OpenStream) -> None:
        self.active_streams.add(stream)

    def stream_ended(self, stream: OpenStream) -> None:
        self.active_streams.discard(stream)

    def dispatch_started(self, task: asyncio.Task[Any]) -> None:
        """`task` waits on a worker from now until `dispatch_ended` (past the drain deadline,
        `proxy.dispatch` answers it at once instead)."""
        self.dispatching.add(task)

    def dispatch_ended(self, task: asyncio.Task[Any]) -> None:
        self.dispatching.discard(task)
        self.ended.discard(task)

    def waiting_on_worker(self, receive: Receive) -> WaitingOnWorker:
        """The current task waits on a worker: while inside, the client leaving (the guard, which
        says whether it `fired`) or the drain deadline cancels it, and so closes the worker's
        request."""
        return WaitingOnWorker(self, receive)

    def end_dispatching(self) -> None:
        """The drain deadline: cancel every request still waiting on a worker. The cancellation
        closes its worker connection on the way out, as a client's disconnect does, and
        `proxy.dispatch` turns it into a 503 `gateway_shutting_down` (`ended_by_drain`), so the
        server's own last-resort timeout never has a request left to cut off."""
        self.past_deadline = True
        for task in list(self.dispatching):
            self._end(task)

    def _end(self, task: asyncio.Task[Any]) -> None:
        if task not in self.ended:
            self.ended.add(task)
            task.cancel()

    def ended_by_drain(self) -> bool:
        """Whether the drain deadline cancelled the current task (and not its client leaving):
        if so the cancellation is taken back, for the request to answer its client itself."""
        task = asyncio.current_task()
        if task is None or task not in self.ended:
            return False
        self.ended.discard(task)
        task.uncancel()
        return True


class WaitingOnWorker:
    """`Lifecycle.waiting_on_worker`'s context, entered by every proxied request: a class, since
    a generator-based context manager cost 1.2 µs more per request (2.8 against 1.6 µs)."""

    __slots__ = ("_guard", "_lifecycle", "_receive", "_task")

    def __init__(self, lifecycle: Lifecycle, receive: Receive) -> None:
        self._lifecycle = lifecycle
        self._receive = receive

    def __enter__(self) -> DisconnectGuard:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._guard = guard = DisconnectGuard(self._receive, self._lifecycle.disconnects, task)
        self._lifecycle.dispatch_started(task)
        return guard

    def __exit__(self, *exc: object) -> None:
        self._lifecycle.dispatch_ended(self._task)
        self._guard.close()


def in_terminal() -> bool:
    """Whether the process runs in the foreground of a terminal (its stdin is one): there SIGHUP is
    the terminal's hangup, not a request to reload."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):  # a closed or detached stdin
        return False
