"""The process's lifecycle as the request path sees it: ready, draining, what is in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import Receive

from gateway.disconnect import DisconnectGuard, DisconnectWatch
from gateway.errors import ApiError

SHUTTING_DOWN = "gateway shutting down"


class OpenStream(Protocol):
    """A streamed response the drain deadline can end (`streaming.ProxyStream`,
    `responses_stream.StoredResponseStream`): the client gets a terminal error event."""

    def abort(self, reason: str) -> None: ...


def shutting_down() -> ApiError:
    """What a request the drain deadline ended before its answer began is told (a retry goes to
    another replica: this one no longer listens)."""
    return ApiError(503, SHUTTING_DOWN, "server_error", "gateway_shutting_down", None, {"retry-after": "1"})


@dataclass(slots=True)
class Lifecycle:
    """`ready` from lifespan startup to shutdown, `draining` once shutdown begins. At its
    deadline the drain (`app.drain`) ends the streams still in `active_streams` and cancels the
    requests still in `dispatching` (waiting on a worker, or for a queue's turn);
    `in_flight_requests` counts completions between arrival and their last byte (the gateway-wide
    cap). Invariant: `ended` holds only tasks of `dispatching` that the deadline cancelled and that
    have not yet taken their cancellation back (`ended_by_drain`)."""

    draining: bool = False
    ready: bool = False
    in_flight_requests: int = 0
    disconnects: DisconnectWatch = field(default_factory=DisconnectWatch)
    active_streams: set[OpenStream] = field(default_factory=set)
    dispatching: set[asyncio.Task[Any]] = field(default_factory=set)
    ended: set[asyncio.Task[Any]] = field(default_factory=set)
    past_deadline: bool = False

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

    @contextlib.contextmanager
    def waiting_on_worker(self, receive: Receive) -> Iterator[DisconnectGuard]:
        """The current task waits on a worker: while inside, the client leaving (the guard, which
        says whether it `fired`) or the drain deadline cancels it, and so closes the worker's
        request."""
        guard = DisconnectGuard(receive, self.disconnects)
        task = asyncio.current_task()
        assert task is not None
        self.dispatch_started(task)
        try:
            yield guard
        finally:
            self.dispatch_ended(task)
            guard.close()

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
