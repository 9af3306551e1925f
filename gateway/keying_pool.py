"""The keying process: large JSON bodies read and keyed beside the event loop, not on it.

A thread would not do: parsing, encoding and keying a body of several megabytes are long calls
that hold the GIL, and the loop waits for each of them whole (docs/normalizer.md, "Cost per
request"). One process per gateway process (under `--processes N`, each has its own), spawned on
the first large body, runs `gateway.large_body.key_body`; the loop then rebuilds the parsed body
from its pieces, giving other requests a turn every couple of milliseconds (`rebuild`).

Lifecycle: at most `MAX_JOBS` bodies are in the process's queue or at work, a body counting until
the process is done with it even when its request left first; later ones wait their turn, handed
out fairly across tenants (`FairSlots`: a tenant's one body waits for at most about one more of a
busy tenant's, not for all of them). How many bodies wait is bounded by the gateway's limits on
requests in flight, and each by the body limit. A process that dies (killed, out of memory)
fails the job it had, which admission then reads and keys in the gateway's own process as
before; the next body starts a new process.
One that ends before answering anything (it cannot start) is not tried again for
`RETRY_START_S`. One with nothing to do for `IDLE_EXIT_S` is stopped, giving back the memory
large bodies left in it (about 120 MB after 7 MB bodies); the next large body starts another
(about 0.7 s). `close` (the app's lifespan end) stops it, and a keying process whose gateway
died exits by itself. Being spawned, it imports the gateway's main module as `__mp_main__`, as
multiprocessing does: the gateway's entry points run nothing on import.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import orjson

from gateway.fair_order import FairOrder
from gateway.large_body import BodyJob, Container, KeyedBody, Member, Piece, Run, Text, Whole, key_body

log = logging.getLogger("kvgate.keying")
T = TypeVar("T")

# Bodies in the keying process's queue or at work at once: one keyed while the next is sent.
MAX_JOBS = 2
# The most work the loop does between two turns of its own while it rebuilds a body.
TURN_S = 0.002
_ORPHAN_CHECK_S = 1.0
# After a keying process that ended before answering anything (it could not start), how long large
# bodies are read and keyed in the gateway's own process before another is tried.
RETRY_START_S = 60.0
# How much lower the keying process's CPU priority is than the gateway's (`os.nice`).
KEYING_NICENESS = 10
# A keying process with no body for this long is stopped (its memory given back).
IDLE_EXIT_S = 300.0


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_ORPHAN_CHECK_S)
    os._exit(0)


def _start_keying_process(parent: int) -> None:
    """In the keying process, first: it yields the CPU to the gateway's event loop when both want
    it (a large body waits a little longer, every other request does not); Ctrl-C is the
    gateway's to handle (it closes the pool); a keying process whose gateway died without closing
    it (SIGKILL) exits."""
    os.nice(KEYING_NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


class FairSlots:
    """`n` slots of keying work handed out one tenant at a time.

    A slot that is free is taken at once (then nobody waits). Otherwise the request waits in
    `fair_order.FairOrder` with every tenant weighted alike, and each slot given back goes
    straight to the next waiter in that order (a newcomer never takes it first):

        tenant A has 10 bodies waiting, then B's one arrives:  A, B, A, A, ...

    so a tenant's body waits for at most about one more of a busy tenant's, however many that
    tenant has queued. Tenants' weights do not apply: a heavy tenant's bodies would then go many
    at a time before a light tenant's one, which is the wait this bounds. A waiter that leaves (its client
    went away) leaves the order, and a slot handed to a waiter that left before using it goes to
    the next. Invariant: `free` > 0 only when nothing waits."""

    __slots__ = ("_order", "free")

    def __init__(self, n: int) -> None:
        self.free = n
        self._order: FairOrder[asyncio.Future[None]] = FairOrder()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._order)

    async def acquire(self, tenant: str) -> None:
        """Hold a slot (give it back with `release`), waiting for `tenant`'s turn if none is free."""
        if self.free > 0:
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = self._order.push(tenant, 1.0, 0, future)
        try:
            await future
        except BaseException:
            if entry.live:
                self._order.remove(entry)
            elif future.done() and not future.cancelled():
                self.release()  # handed a slot, cancelled before it could use it
            raise

    def release(self) -> None:
        """Give a slot back: to the next waiter in fair order, or to the free ones."""
        while (entry := self._order.pop()) is not None:
            if not entry.item.done():  # a done one was cancelled and is leaving
                entry.item.set_result(None)
                return
        self.free += 1

    def check_invariants(self) -> None:
        self._order.check_invariants()
        assert self.free >= 0 and (self.free == 0 or not self._order)


class KeyingPool:
    """One keying process, started on first use and again after it died; see the module doc."""

    def __init__(self, max_jobs: int = MAX_JOBS, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self.idle_exit_s = idle_exit_s
        self._idle: asyncio.TimerHandle | None = None  # stops an idle process (`_stop_if_idle`)
        self._answered = 0  # bodies the current process has answered
        self._retry_s = 0.0  # no process is started before this (monotonic), after one failed to start
        self.slots = FairSlots(max_jobs)
        self.started = 0  # keying processes started (a restart after a death counts too)
        self.in_flight = 0  # bodies sent and not answered yet (at most `max_jobs`)
        self.waiting = 0  # bodies waiting for one of those places

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._executor is None:
            # Spawned, not forked: the gateway has threads (the keying's, the resolver's), and a
            # fork would copy its whole heap and whatever locks they held.
            self._executor = concurrent.futures.ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_keying_process,
                initargs=(os.getpid(),),
            )
            self._answered = 0
            self.started += 1
        return self._executor

    async def key(self, job: BodyJob, tenant: str) -> KeyedBody | None:
        """The keyed body, or None when the keying process died with it (the next job starts
        another) or, for `RETRY_START_S` after one could not start at all, at once. `tenant`
        waits its turn among the tenants whose bodies wait (`FairSlots`)."""
        if time.monotonic() < self._retry_s:
            return None
        self.waiting += 1
        try:
            await self.slots.acquire(tenant)
        finally:
            self.waiting -= 1
        self.in_flight += 1
        executor = self._pool()
        work: concurrent.futures.Future[KeyedBody] | None = None
        try:
            work = executor.submit(key_body, job)
            keyed = await asyncio.wrap_future(work)
            self._answered += 1
            return keyed
        except BrokenProcessPool:
            if self._executor is executor:
                if self._answered == 0:
                    self._retry_s = time.monotonic() + RETRY_START_S
                    log.warning(
                        "the keying process ended before answering: large bodies are read and keyed "
                        "in this process for %.0f s",
                        RETRY_START_S,
                    )
                self._executor = None
                executor.shutdown(wait=False, cancel_futures=True)
            return None
        finally:
            # A request that leaves while its body is in the keying process does not stop the
            # work there: its place is given back when the process is done with it.
            when_done(work, self._job_ended)

    def _job_ended(self) -> None:
        self.in_flight -= 1
        self.slots.release()
        if self.in_flight == 0 and self.waiting == 0:
            self._arm_idle_exit()

    def _arm_idle_exit(self) -> None:
        # One timer per quiet spell, set when the last body leaves (large bodies are rare: the
        # request path of small ones never comes here).
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(self.idle_exit_s, self._stop_if_idle)

    def _stop_if_idle(self) -> None:
        self._idle = None
        if self.in_flight == 0 and self.waiting == 0 and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def pid(self) -> int | None:
        """The keying process's id while one runs (for tests and diagnostics)."""
        executor = self._executor
        processes = getattr(executor, "_processes", None) or {}
        return next(iter(processes), None)

    def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def when_done(work: concurrent.futures.Future[Any] | None, callback: Callable[[], object]) -> None:
    """`callback()` on the running loop once `work` has ended (at once if it has, or was never
    submitted): a thread or process goes on with a job whose caller was cancelled."""
    if work is None or work.done():
        callback()
        return
    loop = asyncio.get_running_loop()

    def ended(_: concurrent.futures.Future[Any]) -> None:
        if not loop.is_closed():  # a job that outlived the app's lifespan
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(callback)

    work.add_done_callback(ended)


async def run_fairly(
    slots: FairSlots, tenant: str, executor: concurrent.futures.Executor, fn: Callable[[], T]
) -> T:
    """`fn()` on `executor` in `tenant`'s turn for one of `slots`, the slot held until `fn` has
    returned (also when the caller is cancelled first)."""
    await slots.acquire(tenant)
    work: concurrent.futures.Future[T] | None = None
    try:
        work = executor.submit(fn)
        return await asyncio.wrap_future(work)
    finally:
        when_done(work, slots.release)


class Turns:
    """Gives the event loop a turn whenever `TURN_S` of work has passed since the last one."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since = time.monotonic()

    async def tick(self) -> None:
        if time.monotonic() - self._since >= TURN_S:
            await asyncio.sleep(0)
            self._since = time.monotonic()


async def rebuild(piece: Piece, turns: Turns) -> Any:
    """The value `piece` was made from (`gateway.large_body.pieces`), parsed a piece at a time."""
    if isinstance(piece, Whole):
        value = orjson.loads(piece.data)
        await turns.tick()
        return value
    if isinstance(piece, Text):
        slices: list[str] = []
        for data in piece.slices:
            slices.append(orjson.loads(data))
            await turns.tick()
        return "".join(slices)
    if piece.is_object:
        members: dict[str, Any] = {}
        for part in piece.parts:
            if isinstance(part, Run):
                members.update(orjson.loads(part.data))
            elif isinstance(part, Member):
                members[part.name] = await rebuild(part.value, turns)
            await turns.tick()
        return members
    items: list[Any] = []
    for part in piece.parts:
        if isinstance(part, Run):
            items.extend(orjson.loads(part.data))
        elif isinstance(part, Whole | Text | Container):
            items.append(await rebuild(part, turns))
        await turns.tick()
    return items
