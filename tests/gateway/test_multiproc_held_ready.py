"""`kvgate serve --processes N`: a process the supervisor holds down (crash-looping past its restart
budget) is not waited for by process 0's `/readyz`. It has no socket, so the kernel hands it no
connection, and the others serve; waiting for it took the whole pod out of service for up to the
10-minute hold. A process restarted within its budget is still waited for, and so is one whose
hold has ended, from before its restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import multiproc
from gateway.lifecycle import ProcessGroup, held_file
from tests.gateway.test_multiproc_restart_budget import _child_1_exiting, _Clock, _spend_child_1s_budget
from tests.support.wait import wait_until_sync


def test_a_held_process_is_not_waited_for_and_its_restart_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = _Clock()
    during_pauses: list[tuple[int, int]] = []  # (waiting, held) as process 0 sees them in each pause

    def sleep(s: float) -> None:
        if s >= 1.0:
            during_pauses.append((group.peers_waiting(), group.peers_held()))
        _Clock.sleep(clock, s)

    monkeypatch.setattr(clock, "sleep", sleep)
    monkeypatch.setattr(multiproc, "time", clock)
    children, crashed = _child_1_exiting(tmp_path, 1)
    assert children.ready is not None
    ready = children.ready.path(1)
    group = ProcessGroup(peer_files=(ready,))  # process 0's view of child 1
    try:
        for i in range(2):
            children.start(i)
        _spend_child_1s_budget(children, crashed)
        # Every restart within the budget is waited for, through its pause.
        assert during_pauses == [(1, 0)] * multiproc.MAX_RESTARTS_PER_MIN
        assert group.peers_waiting() == 1
        assert children.watch()  # past its budget, child 0 serving: child 1 is held down
        assert "(index 1) exited 6 times within a minute" in capsys.readouterr().out
        assert held_file(ready).exists() and not ready.exists()
        assert (group.peers_waiting(), group.peers_held()) == (0, 1)  # used to be (1, 0): 503
        held = children.procs[1]
        assert children.watch() and children.procs[1] is held
        assert (group.peers_waiting(), group.peers_held()) == (0, 1)  # for the whole hold
        clock.offset_s += multiproc.HOLD_MAX_S + 1
        assert children.watch() and children.procs[1] is not held  # its one start after the hold
        # Waited for again from before the pause, and until the restarted child says it is ready.
        assert during_pauses[-1] == (1, 0)
        assert not held_file(ready).exists()
        wait_until_sync(crashed, 30, "child 1 exited")
        assert children.watch()  # exited within a minute of its one start: held again
        assert held_file(ready).exists() and (group.peers_waiting(), group.peers_held()) == (0, 1)
        first = children.procs[0]
        assert first is not None and first.poll() is None
    finally:
        children.stop(10.0)


def test_a_start_clears_a_held_mark_left_behind(tmp_path: Path) -> None:
    """Whatever held it before, a child being started is waited for until it is ready."""
    children, _ = _child_1_exiting(tmp_path, 1)
    assert children.ready is not None
    ready = children.ready.path(1)
    held_file(ready).touch()
    ready.touch()
    try:
        children.start(1)
        assert not held_file(ready).exists() and not ready.exists()
        assert ProcessGroup(peer_files=(ready,)).peers_waiting() == 1
    finally:
        children.stop(10.0)
