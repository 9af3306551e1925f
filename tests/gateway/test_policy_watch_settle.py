"""A policy file rewritten in place is applied whole, never half-written: a version is read once
it has settled (on a clock the test drives), and a read that a writer overtakes is thrown away."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO

import pytest

from gateway import policy_watch
from gateway.file_stamp import FileStamp
from gateway.policy_watch import MANUAL_SETTLE_ROUNDS, PolicyWatcher
from tests.gateway.test_policy_watch import Swaps, write

WHOLE = "policy: cost\nseed: 9\ncost:\n  epsilon: 0.75\n"
HALF = WHOLE[: WHOLE.index("0.75") + 2]  # "... epsilon: 0.": it parses, as 0.0


class Clock:
    """A monotonic clock that moves only when told to (`step` each time it is read, if set)."""

    def __init__(self, step: float = 0.0) -> None:
        self.now = 100.0
        self.step = step
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


def in_place(path: Path, text: str) -> None:
    """A rewrite in place: the same inode, truncated, then written (a shell's `>`, `cp`)."""
    inode = path.stat().st_ino
    with open(path, "w") as f:
        f.write(text)
    assert path.stat().st_ino == inode


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)
    st = path.stat()  # a later mtime even on a file system with a coarse clock
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


async def test_a_half_written_file_is_not_applied_before_it_settles(policy_file: Path) -> None:
    clock = Clock()
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=1.0, monotonic_s=clock)
    w.load_initial()

    in_place(policy_file, HALF)  # the writer pauses here
    for _ in range(3):
        assert await w.check() is None
    clock.now += 0.5
    assert await w.check() is None and swaps.loaded == []

    append(policy_file, WHOLE[len(HALF) :])  # the rest: a new version, which settles anew
    clock.now += 0.9
    assert await w.check() is None and swaps.loaded == []
    clock.now += 1.0
    result = await w.check()
    assert result is not None and result.swapped, result
    assert [s.config.cost.epsilon for s in swaps.loaded] == [0.75]
    assert await w.check() is None


async def test_a_renamed_file_is_read_at_once_and_an_empty_one_waits(policy_file: Path) -> None:
    clock = Clock()
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=30.0, monotonic_s=clock)
    w.load_initial()
    write(policy_file, WHOLE)  # renamed over it: whole when it appears
    result = await w.check()
    assert result is not None and result.swapped and swaps.loaded[0].config.cost.epsilon == 0.75

    write(policy_file, "")  # a new file, still empty: its writer may not have started
    assert await w.check() is None
    clock.now += 30.0
    refused = await w.check()
    assert refused is not None and refused.error is not None and "empty" in refused.error


async def test_a_manual_reload_waits_for_an_in_place_write_to_settle(policy_file: Path) -> None:
    """The writer finishes while `reload_now` waits (the first time the watcher reads its clock,
    the file is still half-written): what is applied is the whole file."""
    clock = Clock(step=0.05)
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=0.05, monotonic_s=clock)
    w.load_initial()
    in_place(policy_file, HALF)
    real_wait = w._settling.wait_s

    def wait_s(stamp: FileStamp) -> float:
        if clock.reads == 0:
            append(policy_file, WHOLE[len(HALF) :])
        return real_wait(stamp)

    w._settling.wait_s = wait_s  # type: ignore[method-assign]
    result = await w.reload_now()
    assert result.swapped, result
    assert [s.config.cost.epsilon for s in swaps.loaded] == [0.75]


async def test_a_manual_reload_waits_out_wakeups_that_come_before_the_clock_says(policy_file: Path) -> None:
    """uvloop's timers count whole milliseconds: `asyncio.sleep(wait_s)` may end up to a
    millisecond before `time.monotonic()` says `wait_s` has passed, and the few hundred
    microseconds left then sleep as 0 ms and end at once. Here each wakeup finds the clock moved
    on by a tenth of the settle time only. One rewrite, one version: it is applied however many
    wakeups its settling takes (each was counted as a version, and the fifth refused the file as
    "kept changing while it was read")."""
    clock = Clock(step=0.001)
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=0.01, monotonic_s=clock)
    w.load_initial()
    in_place(policy_file, WHOLE)
    result = await w.reload_now()
    assert result.swapped, result
    assert [s.config.cost.epsilon for s in swaps.loaded] == [0.75]
    assert clock.reads > MANUAL_SETTLE_ROUNDS  # it did wake more often than versions are waited for


async def test_a_manual_reload_gives_up_on_a_file_that_keeps_changing(policy_file: Path) -> None:
    """A writer that never stops: each look at the file finds a new version. The reload waits for
    `MANUAL_SETTLE_ROUNDS` of them, then refuses the file, applying nothing."""
    clock = Clock(step=0.001)
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=0.01, monotonic_s=clock)
    w.load_initial()
    in_place(policy_file, HALF)
    real_wait = w._settling.wait_s
    versions: set[FileStamp] = set()

    def wait_s(stamp: FileStamp) -> float:
        versions.add(stamp)
        append(policy_file, "5")  # the writer goes on as soon as it was looked at
        return real_wait(stamp)

    w._settling.wait_s = wait_s  # type: ignore[method-assign]
    result = await w.reload_now()
    assert result.error is not None and "kept changing" in result.error, result
    assert swaps.loaded == [] and len(versions) == MANUAL_SETTLE_ROUNDS


async def test_a_read_that_a_writer_overtakes_is_thrown_away(
    policy_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=0)
    w.load_initial()
    read_bytes = policy_watch._read_bytes
    appended = threading.Event()

    def read_while_a_writer_appends(f: BinaryIO) -> bytes:
        data = read_bytes(f)
        if not appended.is_set():  # the rest lands just after the first half was read
            append(policy_file, WHOLE[len(HALF) :])
            appended.set()
        return data

    monkeypatch.setattr(policy_watch, "_read_bytes", read_while_a_writer_appends)
    in_place(policy_file, HALF)
    assert await w.check() is None and w.moved_reads == 1 and swaps.loaded == []
    result = await w.check()
    assert result is not None and result.swapped, result
    assert [s.config.cost.epsilon for s in swaps.loaded] == [0.75]


async def test_a_policy_without_its_pools_section_half_written_keeps_the_index(policy_file: Path) -> None:
    """The reviewer's second case: the first half of a file whose `default_pool` section comes
    last parses, and would have replaced the policy (and its prefix index) with defaults."""
    clock = Clock()
    swaps = Swaps()
    write(policy_file, "policy: cost\nseed: 3\n")
    w = PolicyWatcher(policy_file, swaps, settle_s=1.0, monotonic_s=clock)
    w.load_initial()
    whole = "policy: cost\nseed: 4\ndefault_pool:\n  index:\n    max_entries: 2000000\n"
    half = whole[: whole.index("default_pool")]
    in_place(policy_file, half)
    assert await w.check() is None
    append(policy_file, whole[len(half) :])
    assert await w.check() is None
    clock.now += 1.0
    result = await w.check()
    assert result is not None and result.swapped
    assert [s.config.seed for s in swaps.loaded] == [4]
