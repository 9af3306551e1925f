"""The supervisor of `kvgate serve --processes N` restarts each child within a budget of its own
(`MAX_RESTARTS_PER_MIN` a minute), and every child that exited after one pause: a correlated
crash of N children used to spend N restarts of one group-wide budget (and N pauses)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from gateway import multiproc
from gateway.multiproc import MAX_RESTARTS_PER_MIN, Children
from tests.support.wait import wait_until_sync


def _all_exited(children: Children) -> bool:
    return all(p is not None and p.poll() is not None for p in children.procs)


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
    script = "import sys, time\nif sys.argv[1] == '1': sys.exit(2)\ntime.sleep(600)\n"
    children = Children([sys.executable, "-c", script], 2, {}, lambda i: [str(i)], ready_dir=tmp_path)

    def refused() -> bool:
        proc = children.procs[1]
        return proc is not None and proc.poll() is not None

    try:
        for i in range(2):
            children.start(i)
        for _ in range(MAX_RESTARTS_PER_MIN):
            wait_until_sync(refused, 30, "child 1 exited")
            assert children.watch()
        wait_until_sync(refused, 30, "child 1 exited")
        held = children.procs[1]
        assert children.watch()  # its budget is spent, but child 0 serves: child 1 is held down
        assert children.watch() and children.procs[1] is held  # and not restarted meanwhile
        first = children.procs[0]
        assert first is not None and first.poll() is None
        assert "could not start 6 times within a minute (exit 2" in capsys.readouterr().out
        assert len(pauses) == MAX_RESTARTS_PER_MIN
    finally:
        children.stop(10.0)
