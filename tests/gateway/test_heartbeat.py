"""The heartbeat of `kvgate serve --processes` children and the supervisor's watch over it, without
processes: ages on a clock the test moves (`tests/e2e/test_processes_watchdog.py` runs the real
thing)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.config.base import ConfigError
from gateway.heartbeat import (
    HEARTBEAT_ENV,
    STARTUP_GRACE_S,
    Overdue,
    Watchdog,
    beat,
    read_stamp,
    start_beating,
    touch_stamp,
)
from gateway.multiproc import supervise
from tests.support.wait import wait_until

POLL_S = 0.2  # the supervisor's poll


def _first_overdue_at(
    watchdog: Watchdog, stamp_at: Callable[[float], int], start_s: float, end_s: float
) -> float | None:
    """Poll child 0, whose file is stamped `stamp_at(t)` at time t, every POLL_S from `start_s`
    to `end_s`: when it was first reported overdue."""
    for k in range(round((end_s - start_s) / POLL_S) + 1):
        now = start_s + k * POLL_S
        if watchdog.check([(0, stamp_at(now))], now):
            return now
    return None


def _beats_until(last_s: float) -> Callable[[float], int]:
    """A child beating every second until `last_s`, then silent."""
    return lambda now: int(min(now, last_s))


def test_a_child_that_never_beats_is_overdue_only_after_the_startup_grace() -> None:
    watchdog = Watchdog(timeout_s=5)
    watchdog.started(0, 0, now=0.0)
    at = _first_overdue_at(watchdog, lambda _: 0, 0.0, STARTUP_GRACE_S + 1)
    assert at is not None and STARTUP_GRACE_S < at <= STARTUP_GRACE_S + POLL_S + 1e-6


def test_a_timeout_longer_than_the_grace_is_the_grace() -> None:
    assert Watchdog(timeout_s=STARTUP_GRACE_S * 2).grace_s == STARTUP_GRACE_S * 2


def test_after_its_first_beat_a_child_is_held_to_the_timeout() -> None:
    watchdog = Watchdog(timeout_s=5)
    watchdog.started(0, 0, now=0.0)
    at = _first_overdue_at(watchdog, _beats_until(10.0), 0.0, 30.0)
    assert at is not None and 15.0 < at <= 15.0 + POLL_S + 1e-6


def test_a_child_beating_steadily_is_never_overdue() -> None:
    watchdog = Watchdog(timeout_s=2)
    watchdog.started(0, 0, now=0.0)
    assert _first_overdue_at(watchdog, _beats_until(200.0), 0.0, 199.0) is None


def test_the_stamp_found_at_start_is_not_a_beat() -> None:
    watchdog = Watchdog(timeout_s=5, grace_s=10)
    watchdog.started(0, 7, now=0.0)  # the file a killed child left behind
    at = _first_overdue_at(watchdog, lambda _: 7, 0.0, 11.0)
    assert at is not None and at > 10


def test_a_missing_file_is_no_beat() -> None:
    watchdog = Watchdog(timeout_s=5, grace_s=5)
    watchdog.started(0, None, now=0.0)
    assert watchdog.check([(0, None)], 4.0) == []
    assert [o.index for o in watchdog.check([(0, None)], 5.1)] == [0]


def test_a_supervisor_that_did_not_run_for_a_while_restarts_the_ages_instead_of_killing() -> None:
    watchdog = Watchdog(timeout_s=5)
    watchdog.started(0, 0, now=0.0)
    assert watchdog.check([(0, 1)], 1.0) == []
    # The supervisor itself was stopped for 100 s (and the child with it: the same machine).
    assert watchdog.check([(0, 1)], 101.0) == []
    at = _first_overdue_at(watchdog, lambda _: 1, 101.2, 120.0)
    assert at is not None and 106.0 < at <= 106.0 + POLL_S + 1e-6


def test_children_not_started_or_forgotten_are_not_watched() -> None:
    watchdog = Watchdog(timeout_s=2, grace_s=2)
    watchdog.started(0, 0, now=0.0)
    watchdog.started(1, 0, now=0.0)
    watchdog.forget(1)
    assert watchdog.check([(0, 0), (1, 0), (2, 0)], 2.5) == [Overdue(0, 2.5)]


async def test_beat_renews_the_file_until_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat-0"
    first = touch_stamp(path)
    task = asyncio.create_task(beat(path, interval_s=0.01))
    seen = {first}

    def renewed_twice() -> bool:
        seen.add(read_stamp(path))
        return len(seen) >= 3

    await wait_until(renewed_twice, what="the heartbeat file renewed twice")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_beat_recreates_a_deleted_file(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat-0"
    task = asyncio.create_task(beat(path, interval_s=0.01))
    try:
        await wait_until(path.exists, what="the heartbeat file exists")
        path.unlink()
        await wait_until(path.exists, what="the heartbeat file is back")
    finally:
        task.cancel()


async def test_only_a_supervised_process_beats(tmp_path: Path) -> None:
    assert start_beating({}) is None
    task = start_beating({HEARTBEAT_ENV: str(tmp_path / "hb")})
    assert task is not None
    task.cancel()


@pytest.mark.parametrize("watchdog_s", [-1.0, 0.5, float("nan"), float("inf")])
def test_supervise_refuses_a_watchdog_timeout_it_cannot_keep(watchdog_s: float) -> None:
    with pytest.raises(ConfigError, match="--watchdog-s"):
        supervise(argparse.Namespace(processes=2, watchdog_s=watchdog_s))
