"""The supervisor of `kvgate serve --processes N` restarts each child within a budget of its own
(`MAX_RESTARTS_PER_MIN` a minute), and every child that exited after one pause: a correlated
crash of N children used to spend N restarts of one group-wide budget (and N pauses)."""

from __future__ import annotations

import errno
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway import multiproc
from gateway.multiproc import MAX_RESTARTS_PER_MIN, Children
from tests.support.wait import wait_until_sync


def _all_exited(children: Children) -> bool:
    return all(p is not None and p.poll() is not None for p in children.procs)


def _child_1_exiting(tmp_path: Path, code: int) -> tuple[Children, Callable[[], bool]]:
    """Two children: child 0 serves, child 1 exits with `code` as soon as it starts; and whether
    child 1 has exited."""
    script = f"import sys, time\nif sys.argv[1] == '1': sys.exit({code})\ntime.sleep(600)\n"
    children = Children([sys.executable, "-c", script], 2, {}, lambda i: [str(i)], ready_dir=tmp_path)

    def exited() -> bool:
        proc = children.procs[1]
        return proc is not None and proc.poll() is not None

    return children, exited


def _spend_child_1s_budget(children: Children, exited: Callable[[], bool]) -> None:
    """Child 1 restarted within its budget until it has exited once more than the budget."""
    for _ in range(MAX_RESTARTS_PER_MIN):
        wait_until_sync(exited, 30, "child 1 exited")
        assert children.watch()
    wait_until_sync(exited, 30, "child 1 exited")


def test_each_child_has_its_own_budget_and_one_pause_restarts_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[float] = []
    real_sleep = time.sleep

    def sleep(s: float) -> None:  # the supervisor's pause is recorded, not slept; a poll sleeps
        if s >= 1.0:
            pauses.append(s)
        else:
            real_sleep(s)

    monkeypatch.setattr(multiproc.time, "sleep", sleep)
    # Every child exits at once, as after a correlated crash (an OOM kill of each).
    children = Children([sys.executable, "-c", "pass"], 3, {}, lambda i: [], ready_dir=tmp_path)
    try:
        for i in range(3):
            children.start(i)
        for round_ in range(MAX_RESTARTS_PER_MIN):
            wait_until_sync(lambda: _all_exited(children), 30, "every child exited")
            assert children.watch(), f"gave up at round {round_ + 1}"
            assert len(pauses) == round_ + 1  # one pause for the three restarts
        wait_until_sync(lambda: _all_exited(children), 30, "every child exited")
        assert not children.watch()  # each has now exited once more than its budget allows
    finally:
        children.stop(10.0)


def test_a_child_whose_start_keeps_being_refused_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pauses: list[float] = []
    real_sleep = time.sleep

    def sleep(s: float) -> None:
        if s >= 1.0:
            pauses.append(s)
        else:
            real_sleep(s)

    monkeypatch.setattr(multiproc.time, "sleep", sleep)
    # Child 0 serves; child 1's start is refused, the same way each time (exit code 2).
    children, refused = _child_1_exiting(tmp_path, 2)
    try:
        for i in range(2):
            children.start(i)
        _spend_child_1s_budget(children, refused)
        held = children.procs[1]
        assert children.watch()  # its budget is spent, but child 0 serves: child 1 is held down
        assert children.watch() and children.procs[1] is held  # and not restarted meanwhile
        first = children.procs[0]
        assert first is not None and first.poll() is None
        assert "could not start 6 times within a minute (exit 2" in capsys.readouterr().out
        assert len(pauses) == MAX_RESTARTS_PER_MIN
    finally:
        children.stop(10.0)


class _Clock:
    """The supervisor's `time`: a monotonic clock a test moves on, and pauses recorded, not slept."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s

    def sleep(self, s: float) -> None:
        if s < 1.0:
            time.sleep(s)


def test_a_child_crash_looping_on_its_own_is_held_down_and_the_others_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = _Clock()
    monkeypatch.setattr(multiproc, "time", clock)
    # Child 0 serves; child 1 crashes as soon as it starts (not a refused start: exit code 1).
    children, crashed = _child_1_exiting(tmp_path, 1)

    def spend_the_budget() -> float:
        _spend_child_1s_budget(children, crashed)
        assert children.watch()  # its budget is spent, but child 0 serves: child 1 is held down
        line = capsys.readouterr().out.splitlines()[-1]
        assert "(index 1) exited 6 times within a minute (exit 1" in line, line
        return float(line.rsplit("next try in ", 1)[1].split()[0])

    try:
        for i in range(2):
            children.start(i)
        first_wait_s = spend_the_budget()
        held = children.procs[1]
        clock.offset_s += first_wait_s - 1
        assert children.watch() and children.procs[1] is held  # not before its time
        clock.offset_s += 2
        assert children.watch() and children.procs[1] is not held  # tried again then
        waits = [first_wait_s]
        for _ in range(4):  # crash-looping still: one start after each hold, then a longer hold
            wait_until_sync(crashed, 30, "child 1 exited")
            tried = children.procs[1]
            assert children.watch() and children.procs[1] is tried  # held again, not restarted
            line = capsys.readouterr().out.splitlines()[-1]
            assert "(index 1) exited again after a hold, within a minute (exit 1" in line, line
            waits.append(float(line.rsplit("next try in ", 1)[1].split()[0]))
            clock.offset_s += waits[-1] + 1
            assert children.watch() and children.procs[1] is not tried  # its one start
        # The first hold lasts until the budget has room (about a minute, less the real time its
        # restarts took); each one after a single start is the backoff, 15 s doubled per hold. A
        # held child used to get its whole budget again: five quick restarts after each hold.
        assert 0 < waits[0] <= 60 and waits[1:] == [30.0, 60.0, 120.0, 240.0]
        assert all(w <= multiproc.HOLD_MAX_S for w in waits)
        first = children.procs[0]
        assert first is not None and first.poll() is None  # served all along, never restarted
    finally:
        children.stop(10.0)


def test_a_restart_that_cannot_fork_is_tried_again_and_stops_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(multiproc, "time", _Clock())
    children, exited = _child_1_exiting(tmp_path, 1)
    real_popen = subprocess.Popen
    failures = [OSError(errno.EAGAIN, "Resource temporarily unavailable")]

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if failures:  # the machine out of processes or memory for a moment
            raise failures.pop()
        return real_popen(*args, **kwargs)

    try:
        for i in range(2):
            children.start(i)
        wait_until_sync(exited, 30, "child 1 exited")
        crashed = children.procs[1]
        monkeypatch.setattr(multiproc.subprocess, "Popen", popen)
        assert children.watch()  # the restart failed: the group goes on
        assert children.procs[1] is crashed
        assert (
            "could not restart gateway process (index 1): Resource temporarily unavailable"
            in capsys.readouterr().out
        )
        assert children.watch() and children.procs[1] is not crashed  # tried again, at the next poll
        first = children.procs[0]
        assert first is not None and first.poll() is None
    finally:
        children.stop(10.0)


def test_a_child_exiting_within_its_budget_at_the_same_poll_still_counts_as_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Child 1 crash-loops; child 0 serves but exits once (killed) at the very poll where child 1
    # exits beyond its budget. Child 0 is restarted within its own budget, so it still serves: the
    # group used to count only the children alive at that instant, and gave up (exit 1).
    monkeypatch.setattr(multiproc, "time", _Clock())
    children, crashed = _child_1_exiting(tmp_path, 1)
    try:
        for i in range(2):
            children.start(i)
        _spend_child_1s_budget(children, crashed)
        first = children.procs[0]
        assert first is not None
        first.kill()  # stopped by its PID
        first.wait()
        assert children.watch(), "gave up while child 0 was being restarted within its budget"
        restarted = children.procs[0]
        assert restarted is not None and restarted is not first and restarted.poll() is None
        out = capsys.readouterr().out
        assert "(index 1) exited 6 times within a minute" in out and "giving up" not in out
    finally:
        children.stop(10.0)


def test_a_stop_signal_during_the_restart_pause_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopping: list[int] = []
    clock = _Clock()
    poll_sleep = clock.sleep

    def sleep(s: float) -> None:  # SIGTERM arrives during the supervisor's restart pause
        if s >= 1.0:
            stopping.append(15)
        poll_sleep(s)

    monkeypatch.setattr(multiproc, "time", clock)
    monkeypatch.setattr(clock, "sleep", sleep)
    children = Children([sys.executable, "-c", "pass"], 1, {}, lambda i: [], ready_dir=tmp_path)
    try:
        children.start(0)
        wait_until_sync(lambda: _all_exited(children), 30, "the child exited")
        exited = children.procs[0]
        assert children.watch(lambda: bool(stopping))
        assert stopping and children.procs[0] is exited  # it used to be started after the signal
    finally:
        children.stop(10.0)
