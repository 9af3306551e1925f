"""Background Responses (`"background": true`) as vLLM runs them: a task per response that runs
on after the request was answered, and the recorded events of a streamed one.

vLLM's Responses serving (`create_responses` with `request.background`) stores the response
`queued` and answers at once: plainly with that object, or (streamed) by replaying the events
its background task records, from the first. `GET /v1/responses/{id}?stream=true` replays them
again (after `starting_after`), and only for background streams; a replay ends with the
`response.completed` event and otherwise waits for more, so one whose run was cancelled or
failed stays open with nothing more to send. `cancel` stops the task. The app lifespan owns the
tasks (`close`); recordings are kept for the latest `EVENT_LOG_LIMIT` streamed responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any

log = logging.getLogger("loadtest.emulator")
EVENT_LOG_LIMIT = 1_000
_COMPLETED = b"event: response.completed\n"


class EventLog:
    """The server-sent events of one background stream, in order (index = sequence number)."""

    def __init__(self) -> None:
        self._events: list[bytes] = []
        self._changed = asyncio.Event()

    def append(self, chunk: bytes) -> None:
        """Record a chunk of one or more whole events (each ends with a blank line)."""
        self._events.extend(raw + b"\n\n" for raw in chunk.split(b"\n\n") if raw)
        self._changed.set()

    def wake(self) -> None:
        self._changed.set()

    async def replay(self, start: int) -> AsyncIterator[bytes]:
        """The events from index `start` on, waiting for more as they come, until
        `response.completed` (as vLLM's replay; a run that never completes leaves it waiting)."""
        i = start
        while True:
            self._changed.clear()
            while i < len(self._events):
                event = self._events[i]
                yield event
                if event.startswith(_COMPLETED):
                    return
                i += 1
            await self._changed.wait()


class BackgroundResponses:
    """The running background responses by id, and the event logs of the streamed ones."""

    def __init__(self, log_limit: int = EVENT_LOG_LIMIT) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._logs: OrderedDict[str, EventLog] = OrderedDict()
        self._log_limit = log_limit

    def run(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` for `response_id` until it ends or is cancelled."""
        task = asyncio.create_task(work, name=f"background-{response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda done: self._forget(response_id, done))

    def run_stream(self, response_id: str, events: AsyncGenerator[bytes]) -> EventLog:
        """Record `events` (a response's stream) in the background; its log, to replay."""
        events_log = EventLog()
        self._logs[response_id] = events_log
        self._logs.move_to_end(response_id)
        while len(self._logs) > self._log_limit:
            self._logs.popitem(last=False)
        self.run(response_id, _record(events, events_log))
        return events_log

    def events(self, response_id: str) -> EventLog | None:
        return self._logs.get(response_id)

    async def cancel(self, response_id: str) -> None:
        """Stop the response's task (its engine sequences are aborted) and wait until it ended."""
        task = self._tasks.get(response_id)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def close(self) -> None:
        """Cancel every task still running (app shutdown)."""
        for response_id in list(self._tasks):
            await self.cancel(response_id)

    def _forget(self, response_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(response_id) is task:
            del self._tasks[response_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("background response failed", exc_info=task.exception())


async def _record(events: AsyncGenerator[bytes], events_log: EventLog) -> None:
    try:
        async with contextlib.aclosing(events):
            async for chunk in events:
                events_log.append(chunk)
    finally:
        events_log.wake()
