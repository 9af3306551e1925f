"""`kvgate serve --processes 2 --watchdog-s S`: a gateway process whose event loop stops (SIGSTOP
here) is killed and replaced, and the port serves again; healthy idle processes are left alone."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import Proc, alive, gateway_processes, metrics_urls, processes_demo
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-watchdog"
WATCHDOG_S = 5.0  # well above a loaded machine's scheduling delays, short for the test


@pytest.fixture(scope="module")
def group() -> Iterator[tuple[str, Proc]]:
    with processes_demo(KEY, "--watchdog-s", str(WATCHDOG_S)) as running:
        yield running


def _heartbeat_file(pid: int) -> Path:
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return Path(next(e for e in environ if e.startswith("KVGATE_HEARTBEAT_FILE=")).split("=", 1)[1])


def _served(metrics_url: str) -> int:
    with httpx.Client(timeout=5) as client:
        text = client.get(metrics_url).text
    found = re.search(r'kvgate_requests_total\{endpoint="chat",[^}]*status="200"[^}]*\} (\S+)', text)
    return int(float(found.group(1))) if found else 0


def _ask(base: str) -> None:
    body = {
        "model": "kvgate-demo",
        "messages": [{"role": "user", "content": "Still there?"}],
        "max_tokens": 4,
    }
    # A fresh client is a fresh connection: the kernel picks the process.
    with httpx.Client(timeout=30) as client:
        resp = client.post(
            base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
    assert resp.status_code == 200, resp.text


def test_idle_processes_that_keep_beating_are_not_restarted(group: tuple[str, Proc]) -> None:
    _, proc = group
    pids = gateway_processes(proc.popen.pid)
    assert len(pids) == 2
    files = [_heartbeat_file(pid) for pid in pids]
    assert len(set(files)) == 2
    first = [f.stat().st_mtime_ns for f in files]
    span_ns = int((WATCHDOG_S + 2) * 1e9)
    # Both keep beating for longer than the watchdog's timeout while nothing is asked of them.
    wait_until_sync(
        lambda: all(f.stat().st_mtime_ns - t0 >= span_ns for f, t0 in zip(files, first, strict=True)),
        60,
        "both heartbeats advanced past the watchdog timeout",
        interval_s=0.2,
    )
    assert gateway_processes(proc.popen.pid) == pids
    assert "no heartbeat" not in proc.output()


def test_a_stopped_process_is_killed_and_replaced_and_the_port_serves(group: tuple[str, Proc]) -> None:
    base, proc = group
    before = gateway_processes(proc.popen.pid)
    assert len(before) == 2
    listening = len(metrics_urls(proc))
    victim = min(before)
    os.kill(victim, signal.SIGSTOP)
    try:
        wait_until_sync(lambda: not alive(victim), 60, "the stopped process is gone")
        assert re.search(rf"gateway process {victim} \(index \d\) sent no heartbeat for \S+ s", proc.output())

        def replaced_by() -> set[int]:
            now = gateway_processes(proc.popen.pid)
            return now - before if len(now) == 2 else set()

        replaced = wait_until_sync(replaced_by, 60, "a new gateway process runs")
        urls = wait_until_sync(
            lambda: metrics_urls(proc)[listening:], 60, "the new process listens", interval_s=0.2
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert len(replaced) == 1 and before - {victim} <= gateway_processes(proc.popen.pid)
    # Fresh connections land on both processes (the chance that 20 all go to the survivor is
    # about 1e-6) and every one is answered.
    for _ in range(20):
        _ask(base)
    assert _served(urls[0]) >= 1
