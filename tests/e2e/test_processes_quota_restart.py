"""`kvgate serve --processes 2`: a process restarted after a crash grants no tenant a fresh rate
bucket. Its buckets start as an empty bucket refilled while it was gone; they used to start full,
so that a tenant that had spent its rpm got about a minute's budget more through the restarted
process."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

from tests.e2e.harness import (
    SECRET,
    alive,
    chat_burst,
    gateway_processes,
    metrics_urls,
    serving_processes,
    start_emulator,
    tenant,
    write_gateway_config,
)
from tests.e2e.test_processes_quotas import _admitted
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-quota-restart"
RPM = 12


def _index(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e for e in environ if e.startswith(b"KVGATE_PROCESS_INDEX=")).decode().split("=")[1]


def _ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def test_a_restarted_process_grants_no_fresh_bucket(tmp_path: Path) -> None:
    worker, emulator = start_emulator("--model", "m", "--time-scale", "20")
    try:
        pools = [{"name": "p", "models": ["m"], "workers": [worker]}]
        config = write_gateway_config(tmp_path / "gw.yaml", pools, [tenant("t", KEY, quotas={"rpm": RPM})])
        env = {"KVGATE_KEY_SECRET": SECRET.decode()}
        with serving_processes("--config", str(config), env=env) as (base_url, proc):
            assert 0 < chat_burst(base_url, KEY, 3 * RPM).count(200) <= RPM + 2  # the tenant's rpm is spent
            (crashing,) = (pid for pid in gateway_processes(proc.popen.pid) if _index(pid) == "1")
            before = set(metrics_urls(proc))
            os.kill(crashing, signal.SIGKILL)
            wait_until_sync(lambda: not alive(crashing), 30, "the process is gone")

            def restarted() -> bool:
                # Process 0's /readyz is 503 until process 1 is ready again; process 1's, until it is.
                return len(set(metrics_urls(proc)) - before) == 1 and _ready(base_url)

            wait_until_sync(restarted, 60, "process 1 restarted and ready")
            (new_url,) = set(metrics_urls(proc)) - before
            after = chat_burst(base_url, KEY, 4 * RPM)
            by_restarted = _admitted(new_url)
            assert proc.stop() == 0
    finally:
        emulator.stop()
    # Full, the restarted process's bucket admitted about RPM of the ~2 RPM requests the kernel
    # dealt it; now it admits what the bucket refilled since the crash (RPM a minute).
    assert by_restarted < RPM // 2, (by_restarted, after)
    assert after.count(200) < RPM // 2, after
