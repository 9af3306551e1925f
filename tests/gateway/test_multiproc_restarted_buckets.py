"""A process `kvgate serve --processes` restarts in place of one that exited starts its tenants'
rate buckets as an empty bucket refilled since that one was gone; a first start's are full.
Restarted processes used to start full: each crash granted a tenant up to a bucket more, whatever
it had spent through the process that died (the buckets are per process, each kept equal to the
fleet's by the peers' charges, so the past spending lived only in the processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gateway.config import QuotaConfig
from gateway.lifecycle import PROCESS_INDEX_ENV
from gateway.multiproc import Children
from gateway.quotas import RESTARTED_ENV, TenantLimiter, restarted_after_s_of
from gateway.rate_buckets import BUCKET_WINDOW_S, TokenBucket
from tests.support.wait import wait_until_sync

RPM = 12


def _admitted(limiter: TenantLimiter, now_s: float, attempts: int) -> int:
    admitted = 0
    for _ in range(attempts):
        if limiter.enter(now_s) is None:
            limiter.release(0, now_s)
            admitted += 1
    return admitted


def test_a_first_start_admits_a_whole_bucket_at_once() -> None:
    limiter = TenantLimiter(QuotaConfig(rpm=RPM, tpm=1000), 0.0)
    assert _admitted(limiter, 0.0, 2 * RPM) == RPM


def test_a_restart_grants_what_the_bucket_refilled_while_the_process_was_gone() -> None:
    limiter = TenantLimiter(QuotaConfig(rpm=RPM, tpm=1200), 0.0, restarted_after_s=BUCKET_WINDOW_S / 4)
    assert limiter.remaining(0.0) == {"requests": RPM / 4, "tokens": 300.0}
    assert _admitted(limiter, 0.0, 2 * RPM) == RPM // 4
    assert limiter.enter(0.0) is not None  # told when to try again, as a spent tenant is
    assert _admitted(limiter, BUCKET_WINDOW_S / 2, 2 * RPM) == RPM // 2  # refilling at its rate
    assert _admitted(limiter, 10 * BUCKET_WINDOW_S, 2 * RPM) == RPM  # full again after a window


def test_a_process_gone_a_whole_window_starts_full() -> None:
    limiter = TenantLimiter(QuotaConfig(rpm=RPM), 0.0, restarted_after_s=10 * BUCKET_WINDOW_S)
    assert _admitted(limiter, 0.0, 2 * RPM) == RPM


@pytest.mark.parametrize(
    ("value", "admitted"),
    [("0.0", 0), ("15", RPM // 4), ("nan", 0), ("junk", 0), ("-5", 0), ("inf", RPM), ("1e400", RPM)],
)
def test_the_limiter_reads_the_supervisors_word(value: str, admitted: int) -> None:
    # `inf` (gone for ever) used to count as 0: every tenant started empty.
    gone_s = restarted_after_s_of({PROCESS_INDEX_ENV: "1", RESTARTED_ENV: value})
    assert _admitted(TenantLimiter(QuotaConfig(rpm=RPM), 0.0, restarted_after_s=gone_s), 0.0, RPM) == admitted


def test_a_single_process_ignores_an_inherited_restart_variable() -> None:
    # A `kvgate serve` that no supervisor started (no process index), from a shell that has the
    # variable, used to start every tenant's buckets nearly empty.
    gone_s = restarted_after_s_of({RESTARTED_ENV: "0.5"})
    assert _admitted(TenantLimiter(QuotaConfig(rpm=RPM), 0.0, restarted_after_s=gone_s), 0.0, 2 * RPM) == RPM


def test_a_refilling_bucket_keeps_its_invariants() -> None:
    for gone_s in (0.0, 1.0, BUCKET_WINDOW_S, 2 * BUCKET_WINDOW_S):
        bucket = TokenBucket(RPM, 0.0, refilling_for_s=gone_s)
        bucket.check_invariants()
        assert bucket.level(BUCKET_WINDOW_S) == RPM
        bucket.check_invariants()


def test_the_supervisor_tells_only_a_restarted_child_how_long_it_was_gone(tmp_path: Path) -> None:
    out = tmp_path / "restarted"
    script = f"import os\nopen({str(out)!r}, 'a').write(os.environ.get({RESTARTED_ENV!r}, '-') + ' ')\n"
    children = Children([sys.executable, "-c", script], 1, {}, lambda i: [])

    def exited() -> bool:
        proc = children.procs[0]
        return proc is not None and proc.poll() is not None

    try:
        children.start(0)
        wait_until_sync(lambda: out.exists() and out.read_text() == "- ", 30, "the first start wrote")
        wait_until_sync(exited, 30, "the first exited")
        assert children.watch()
        wait_until_sync(lambda: len(out.read_text().split()) == 2, 30, "the restart wrote")
        gone_s = float(out.read_text().split()[1])
        assert gone_s >= 1.0  # the supervisor's pause, at least
    finally:
        children.stop(10.0)
