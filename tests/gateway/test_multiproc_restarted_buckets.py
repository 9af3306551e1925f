"""A process `kvgate serve --processes` restarts in place of one that exited starts its tenants'
rate buckets empty, refilling at their rate; a first start's are full. Restarted processes used to
start full: each crash granted a tenant up to a bucket more, whatever it had spent through the
process that died (the buckets are per process, each one kept equal to the fleet's by the peers'
charges, so the past spending lived only in the processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gateway.config import QuotaConfig
from gateway.multiproc import Children
from gateway.quotas import RESTARTED_ENV, TenantLimiter
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
    limiter = TenantLimiter(QuotaConfig(rpm=RPM, tpm=1000), 0.0, restarted=False)
    assert _admitted(limiter, 0.0, 2 * RPM) == RPM


def test_a_restarted_process_grants_no_bucket_and_refills_at_its_rate() -> None:
    limiter = TenantLimiter(QuotaConfig(rpm=RPM, tpm=1000), 0.0, restarted=True)
    assert limiter.remaining(0.0) == {"requests": 0.0, "tokens": 0.0}
    assert _admitted(limiter, 0.0, 2 * RPM) == 0
    assert limiter.enter(0.0) is not None  # told when to try again, as a spent tenant is
    assert _admitted(limiter, BUCKET_WINDOW_S / 2, 2 * RPM) == RPM // 2
    assert _admitted(limiter, 10 * BUCKET_WINDOW_S, 2 * RPM) == RPM  # full again after a window


def test_the_limiter_reads_the_supervisors_word(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESTARTED_ENV, "1")
    assert _admitted(TenantLimiter(QuotaConfig(rpm=RPM), 0.0), 0.0, RPM) == 0
    monkeypatch.setenv(RESTARTED_ENV, "0")
    assert _admitted(TenantLimiter(QuotaConfig(rpm=RPM), 0.0), 0.0, RPM) == RPM


def test_an_empty_bucket_keeps_its_invariants() -> None:
    bucket = TokenBucket(RPM, 0.0, empty=True)
    bucket.check_invariants()
    assert bucket.level(BUCKET_WINDOW_S) == RPM
    bucket.check_invariants()


def test_the_supervisor_tells_only_a_restarted_child(tmp_path: Path) -> None:
    out = tmp_path / "restarted"
    script = f"import os\nopen({str(out)!r}, 'a').write(os.environ[{RESTARTED_ENV!r}])\n"
    children = Children([sys.executable, "-c", script], 1, {RESTARTED_ENV: "1"}, lambda i: [])
    try:
        children.start(0)
        wait_until_sync(lambda: out.exists() and out.read_text() == "0", 30, "the first start wrote")
        wait_until_sync(
            lambda: children.procs[0] is not None and children.procs[0].poll() is not None, 30, "exit"
        )
        assert children.watch()
        wait_until_sync(lambda: out.read_text() == "01", 30, "the restart wrote")
    finally:
        children.stop(10.0)
