"""Liveness of the processes of `kvgate serve --processes N`: a heartbeat only a running event loop
can produce, and the supervisor's watch over it.

A child whose event loop is stuck (a deadlock on a lock, a runaway CPU-bound call, SIGSTOP) keeps
its listening socket, so the kernel keeps handing it a share of new connections, which then hang;
and it never exits, so nothing restarts it. Each child is therefore given a file
(`HEARTBEAT_ENV`) whose modification time a task on its event loop renews every `INTERVAL_S`
(`beat`); the supervisor (`gateway.multiproc`) polls the files and kills a child whose file has
stopped changing for its timeout (`Watchdog`).

The supervisor never compares the children's clocks with its own: it only notes, on its own
monotonic clock, when it last *saw* a file change, so a wall-clock step changes nothing. A child
has `STARTUP_GRACE_S` (or the timeout, if longer) from its start to its first beat: imports, the
config, the policy and the first health round come before its event loop runs the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvgate.heartbeat")

HEARTBEAT_ENV = "KVGATE_HEARTBEAT_FILE"
INTERVAL_S = 1.0
STARTUP_GRACE_S = 60.0
MIN_TIMEOUT_S = 2 * INTERVAL_S


def start_beating(environ: Mapping[str, str]) -> asyncio.Task[None] | None:
    """The heartbeat task when this process has a supervisor watching it (`HEARTBEAT_ENV` set),
    else None. The caller owns the task and cancels it on shutdown."""
    path = environ.get(HEARTBEAT_ENV)
    if not path:
        return None
    return asyncio.create_task(beat(Path(path)), name="heartbeat")


async def beat(path: Path, interval_s: float = INTERVAL_S) -> None:
    """Renew `path`'s modification time every `interval_s` while the event loop runs."""
    warned = False
    while True:
        try:
            # On the loop itself, on purpose: a thread would make a busy executor look like a hang.
            renew(path)
        except OSError as exc:
            # The supervisor will take the silence for a hang and restart this process: say why once.
            if not warned:
                log.warning("cannot write the heartbeat file", extra={"path": str(path), "error": str(exc)})
                warned = True
        await asyncio.sleep(interval_s)


def renew(path: Path) -> None:
    """One `utime` call on a local file's metadata (microseconds); creates the file if it is gone."""
    try:
        os.utime(path)
    except FileNotFoundError:
        path.touch()


def read_stamp(path: Path) -> int | None:
    """The heartbeat file's modification time in ns, None when it is missing."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def touch_stamp(path: Path) -> int | None:
    """Create (or renew) `path` and return its stamp: the baseline a new child's beats must change."""
    with contextlib.suppress(OSError):
        renew(path)
    return read_stamp(path)


@dataclass(slots=True)
class _Watched:
    stamp: int | None  # the file's stamp when last looked at
    since_s: float  # supervisor's clock: when the stamp last changed (or the child started)
    allowed_s: float  # how long it may stay unchanged: the startup grace, then the timeout


@dataclass(frozen=True, slots=True)
class Overdue:
    """A child whose heartbeat has not changed for `silent_s` (past what it was allowed)."""

    index: int
    silent_s: float


class Watchdog:
    """Which of N children's heartbeats are overdue, from the stamps the supervisor reads.

    Invariant: every watched child has `since_s` <= the last `check`'s `now`, and `allowed_s` is
    the startup grace until its stamp first changes, the timeout afterwards. A supervisor that
    itself did not run for more than half the timeout (stopped, or starved of CPU) cannot tell a
    hung child from one it did not look at: the ages start again from that check rather than
    condemning every child at once."""

    def __init__(self, timeout_s: float, grace_s: float = STARTUP_GRACE_S) -> None:
        self.timeout_s = timeout_s
        self.grace_s = max(grace_s, timeout_s)
        self._watched: dict[int, _Watched] = {}
        self._last_check_s: float | None = None

    def started(self, index: int, stamp: int | None, now: float) -> None:
        """Child `index` was (re)started at `now`, its file stamped `stamp`: its first beat is due
        within the grace."""
        self._watched[index] = _Watched(stamp, now, self.grace_s)

    def forget(self, index: int) -> None:
        self._watched.pop(index, None)

    def check(self, stamps: Sequence[tuple[int, int | None]], now: float) -> list[Overdue]:
        """Note the (index, stamp) pairs read at `now`; the children silent for longer than allowed."""
        stalled = self._last_check_s is not None and now - self._last_check_s > self.timeout_s / 2
        self._last_check_s = now
        overdue: list[Overdue] = []
        for index, stamp in stamps:
            watched = self._watched.get(index)
            if watched is None:
                continue
            if stamp is not None and stamp != watched.stamp:
                watched.stamp = stamp
                watched.since_s = now
                watched.allowed_s = self.timeout_s
            elif stalled:
                watched.since_s = now
            elif now - watched.since_s > watched.allowed_s:
                overdue.append(Overdue(index, now - watched.since_s))
        return overdue
