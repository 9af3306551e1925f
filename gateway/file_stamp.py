"""What says a watched file changed (the policy file, a workers file), and when a changed version
may be read: its modification and change times, size and inode. A rewrite in place changes the
times and maybe the size; a replacement by rename (a ConfigMap update, an atomic deploy) changes
the inode.

A file rewritten in place (truncated, then written) is half-written for a moment, so both watchers
read a changed version only once it looks whole (`Settling`) and use a read only if the file's
stamp held still through it (`read_file`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

MAX_SETTLE_S = 1.0


@dataclass(frozen=True, slots=True)
class FileStamp:
    mtime_ns: int
    ctime_ns: int
    size: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def stamp(path: str | os.PathLike[str]) -> FileStamp:
    """The stamp of the file at `path` now (raises `OSError` as `os.stat` does)."""
    return FileStamp.of(os.stat(path))


@dataclass(frozen=True, slots=True)
class FileRead:
    """One read of a file: its stamp as it was opened, and whether the stamp moved by the end."""

    stamp: FileStamp
    data: bytes
    moved: bool


def read_file(path: str | os.PathLike[str], read_bytes: Callable[[BinaryIO], bytes]) -> FileRead:
    """Read the file at `path` with `read_bytes` (which bounds the size), noting whether its stamp
    moved meanwhile: a writer was at work, and what was read may be half of anything."""
    with open(path, "rb") as f:
        before = FileStamp.of(os.fstat(f.fileno()))
        data = read_bytes(f)
        after = FileStamp.of(os.fstat(f.fileno()))
    return FileRead(before, data, moved=after != before)


def settle_time_s(interval_s: float) -> float:
    """How long a file rewritten in place must go unwritten before it is read: half a check
    interval, at most `MAX_SETTLE_S`."""
    return min(interval_s / 2, MAX_SETTLE_S)


@dataclass(frozen=True, slots=True)
class _Unsettled:
    """A changed version waiting for its writer to be done: its stamp, and when it was first seen
    (monotonic)."""

    stamp: FileStamp
    seen_s: float


class Settling:
    """Whether a changed version of one watched file looks whole: `wait_s(stamp)` is how long it
    must still go unwritten. The watcher sets `inode` to the version's once it has read one whole,
    and calls `forget()` when the file is back to a version it knows."""

    def __init__(self, settle_s: float, monotonic_s: Callable[[], float] = time.monotonic) -> None:
        self.settle_s = settle_s
        self.inode = -1  # of the version read last
        self._monotonic_s = monotonic_s
        self._unsettled: _Unsettled | None = None

    def wait_s(self, stamp: FileStamp) -> float:
        """How long the version with `stamp` must still go unwritten before it is read: nothing
        for a non-empty file that replaced the one read last (a new inode: renamed over it, or a
        ConfigMap's symlink swapped), else what remains of `settle_s` since this process first saw
        it (a write since would have changed its stamp). Only our own clock counts: a modification
        time from a server's clock that runs behind, or kept to the second, would make a write
        just made look settled."""
        if stamp.inode != self.inode and stamp.size > 0:
            return 0.0
        now_s = self._monotonic_s()
        if self._unsettled is None or self._unsettled.stamp != stamp:
            self._unsettled = _Unsettled(stamp, now_s)
        return max(0.0, self.settle_s - (now_s - self._unsettled.seen_s))

    def forget(self) -> None:
        """No version is waiting any more (the file is back to one already read, or was read)."""
        self._unsettled = None
