"""Per-worker connection slots, the shared timeout sweep and the connect deadline (`done_within`)
of the lean upstream client.

Both replace per-request asyncio machinery on the hot path: a free slot is taken with a counter
(no semaphore, no timeout context), and in-flight requests' timeouts are checked by one periodic
timer instead of a timer each (a uvloop timer armed and cancelled costs about 2.6 µs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any, Protocol


class Clock(Protocol):
    """Seconds on a monotonic clock, read as the event loop's are (the loop is one)."""

    def time(self) -> float: ...


class Expiring(Protocol):
    def check_timeout(self, now: float) -> None:
        """Fail if a deadline has passed by `now` (on the sweep's clock); leave the sweep through
        `discard`."""


class TimeoutSweep:
    """Timeouts of the requests in flight, checked by one timer every `tick_s` while any is in
    flight. A timeout fires up to `tick_s` late.

    Deadlines are set and checked on one clock: `clock` when given, else the event loop's. The
    timer runs on the loop's time whatever the clock, so a clock that moves only when told (a
    test's) makes a timeout fire exactly when it is moved past a deadline and `check` runs."""

    def __init__(self, tick_s: float = 0.05, clock: Clock | None = None) -> None:
        self.tick_s = tick_s
        self.clock = clock
        self._busy: dict[Expiring, None] = {}
        self._timer: asyncio.TimerHandle | None = None

    def clock_for(self, loop: asyncio.AbstractEventLoop) -> Clock:
        """The clock that deadlines checked by this sweep are set on, for an item on `loop`."""
        return self.clock if self.clock is not None else loop

    def add(self, item: Expiring) -> None:
        self._busy[item] = None
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)

    def discard(self, item: Expiring) -> None:
        self._busy.pop(item, None)

    def check(self) -> None:
        """Fail now every item whose deadline has passed (the timer's tick, and a test's)."""
        now = self.clock_for(asyncio.get_running_loop()).time()
        for item in list(self._busy):
            item.check_timeout(now)

    def _tick(self) -> None:
        self.check()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.tick_s, self._tick) if self._busy else None


class ConnectionSlots:
    """One worker's connection slots: a counter on the fast path, and a FIFO of waiters when
    every slot is busy. Invariant after every call: no free slot while a pending waiter waits.

    A waiter whose task was cancelled stays in the queue, already done, until its task runs again
    and removes it; slots skip such waiters, so a cancellation never loses or double-hands a slot.
    """

    __slots__ = ("capacity", "free", "users", "waiters")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self.users = 0  # requests holding or waiting for a slot
        self.waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        """Take a free slot at once if there is one and nobody waits for it."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def wait(self, timeout_s: float) -> None:
        """Wait for a slot; TimeoutError after `timeout_s`."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self._hand_over()  # a cancelled waiter still queued may have hidden a free slot from `take`
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give()  # a slot was handed over just as we gave up: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise

    def give(self) -> None:
        self.free += 1
        self._hand_over()

    def _hand_over(self) -> None:
        """Free slots go to the oldest waiters still waiting."""
        while self.free > 0 and self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.free -= 1
                waiter.set_result(None)


STALL_S = 0.02  # a timer this late means this process did not run, not that the worker was slow


async def done_within(future: asyncio.Future[Any], timeout_s: float) -> bool:
    """Whether `future` is done within `timeout_s` of the time this process ran. When this
    process stalled past the deadline (a long garbage collection, a starved machine), the timer
    is due as soon as the loop runs again, before a connect the worker accepted meanwhile can
    finish (libuv runs due timers before it polls; asyncio reads the sockets first, but a connect
    takes more loop turns to finish): it would count as the worker's timeout. A deadline reached
    that late is given once as long again as it was late."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    done, _ = await asyncio.wait((future,), timeout=timeout_s)
    late = loop.time() - deadline
    if not done and late > STALL_S:
        done, _ = await asyncio.wait((future,), timeout=late)
    return bool(done)
