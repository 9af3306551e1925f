"""Cancel-on-disconnect for requests waiting on a worker.

uvicorn reports a client's disconnect only to whoever awaits `receive()`, and a send to a client
that has gone returns silently, so a request waiting on a worker (for the answer head, a whole
non-streamed answer, or the next chunk of a stream) needs a watcher to notice and cancel it, and
with it the worker's request. Most requests finish within a fraction of a second, so watchers are
started only for requests still waiting after `DisconnectWatch.delay_s`, by one periodic tick:
a quick request pays a dict insert and removal, not a timer or a task each (a uvloop timer armed
and cancelled costs about 2.6 µs).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive


class DisconnectGuard:
    """Cancels the current task when the client disconnects (see the module docstring), from
    creation until `close`. After `close`, `fired` says whether it did; the task's cancellation
    is then taken back, so the caller can end the request normally."""

    __slots__ = ("_receive", "_task", "_watch", "_watcher", "fired")

    def __init__(
        self, receive: Receive, watch: DisconnectWatch, task: asyncio.Task[Any] | None = None
    ) -> None:
        self._receive = receive
        self._task = task if task is not None else asyncio.current_task()  # `task`: the caller's
        self._watch = watch
        self._watcher: asyncio.Future[None] | None = None
        self.fired = False
        watch.add(self)

    def start(self) -> None:
        self._watcher = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.fired = True
                if self._task is not None:
                    self._task.cancel()
                return

    def stop_watching(self) -> None:
        """Stop watching, without ending the guard (`close` still must run). For a response that
        is about to complete: uvicorn answers `receive()` with `http.disconnect` as soon as the
        response is complete, which must not cancel what the task still does after it."""
        self._watch.discard(self)
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def close(self) -> None:
        self.stop_watching()
        if self.fired and self._task is not None:
            self._task.uncancel()


class DisconnectWatch:
    """Starts the watchers of requests waiting longer than `delay_s`, from one timer per
    `delay_s / 2` while any request waits (one timer per request cost more than the rest of
    the guard)."""

    def __init__(self, delay_s: float = 0.25) -> None:
        self.delay_s = delay_s
        self._waiting: dict[DisconnectGuard, float] = {}  # in arrival order
        self._timer: asyncio.TimerHandle | None = None

    def add(self, guard: DisconnectGuard) -> None:
        loop = asyncio.get_running_loop()
        self._waiting[guard] = loop.time()
        if self._timer is None:
            self._timer = loop.call_later(self.delay_s / 2, self._tick)

    def discard(self, guard: DisconnectGuard) -> None:
        self._waiting.pop(guard, None)

    def _tick(self) -> None:
        waiting = self._waiting
        loop = asyncio.get_running_loop()
        due_s = loop.time() - self.delay_s
        while waiting:
            guard, since_s = next(iter(waiting.items()))
            if since_s > due_s:
                break
            del waiting[guard]
            guard.start()
        self._timer = loop.call_later(self.delay_s / 2, self._tick) if waiting else None
