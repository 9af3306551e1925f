"""SIGHUP reloads the policy file of a real `kvgate serve` process (and of every process under
`--processes N`, through the supervisor) and never stops it: it keeps serving, and says so. In a
terminal's foreground it is the terminal's hangup, and the gateway stops."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth import hash_api_key
from tests.support.gateway_config import SECRET, tenant, write_gateway_config
from tests.support.processes import REPO, Proc, free_port, start, start_gateway, wait_http
from tests.support.wait import wait_until_sync

ADMIN_KEY = "sk-admin-sighup"
KEY = "sk-sighup"


def _rename_in(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _config(folder: Path, worker: str, policy: bool) -> Path:
    extra: dict[str, Any] = {"admin": {"api_key_hash": hash_api_key(SECRET, ADMIN_KEY)}}
    if policy:
        _rename_in(folder / "policy.yaml", "policy: round_robin\n")
        # The longest interval: a change is not seen by the watcher's own poll during the test.
        extra |= {"policy_file": "policy.yaml", "policy_reload_interval_s": 60}
    return write_gateway_config(
        folder / "gw.yaml", [{"name": "p", "models": ["m"], "workers": [worker]}], [tenant("t", KEY)], **extra
    )


def _served(base: str) -> bool:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    resp = httpx.post(
        base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    return resp.status_code == 200


def _policy(base: str) -> dict[str, Any]:
    resp = httpx.get(base + "/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    policy: dict[str, Any] = resp.json()["policy"]
    return policy


def _reloads(metrics_url: str, result: str) -> float:
    page = httpx.get(metrics_url, timeout=10).text
    found = re.search(rf'^kvgate_policy_reloads_total{{result="{result}"}} (\S+)$', page, re.M)
    return float(found.group(1)) if found else -1.0


@pytest.fixture
def gateway(tmp_path: Path, emulator: str, request: pytest.FixtureRequest) -> Iterator[tuple[Proc, str, str]]:
    port, metrics_port = free_port(), free_port()
    proc = start_gateway(_config(tmp_path, emulator, policy=request.param), port, metrics_port)
    try:
        yield proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        proc.stop()


@pytest.mark.parametrize("gateway", [True], indirect=True)
def test_sighup_reloads_the_policy_file_and_the_gateway_keeps_serving(
    gateway: tuple[Proc, str, str], tmp_path: Path
) -> None:
    proc, base, metrics_url = gateway
    assert _policy(base)["name"] == "round_robin"
    _rename_in(tmp_path / "policy.yaml", "policy: least_load\n")
    proc.popen.send_signal(signal.SIGHUP)
    wait_until_sync(lambda: _policy(base)["name"] == "least_load", 15, "the policy reloaded on SIGHUP")
    assert proc.popen.poll() is None and _served(base)
    wait_until_sync(lambda: "SIGHUP: policy reload applied" in proc.output(), 10, "the reload logged")
    assert _reloads(metrics_url, "applied") == 1.0
    assert "SIGHUP: reloading the policy file" in proc.output()

    proc.popen.send_signal(signal.SIGHUP)  # the same file again: nothing to rebuild
    wait_until_sync(lambda: _reloads(metrics_url, "unchanged") == 1.0, 15, "an unchanged reload counted")
    assert proc.popen.poll() is None and _served(base)
    assert _policy(base)["policy_file"]["reloads"] == 1


@pytest.mark.parametrize("gateway", [False], indirect=True)
def test_sighup_without_a_policy_file_says_so_and_keeps_serving(gateway: tuple[Proc, str, str]) -> None:
    proc, base, _ = gateway
    proc.popen.send_signal(signal.SIGHUP)
    wait_until_sync(lambda: "no policy file to reload" in proc.output(), 15, "the SIGHUP logged")
    assert proc.popen.poll() is None and _served(base)


def test_sighup_to_the_supervisor_reloads_every_process(tmp_path: Path, emulator: str) -> None:
    config = _config(tmp_path, emulator, policy=True)
    port = free_port()
    argv = [
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--processes", "2",
        "--port", str(port), "--metrics-port", "0", "--watchdog-s", "0",
    ]  # fmt: skip
    proc = start(argv, env={"KVGATE_KEY_SECRET": SECRET.decode()})
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=60)

        def metrics() -> list[str]:
            return sorted(set(re.findall(r"metrics (http://127\.0\.0\.1:\d+/metrics)", proc.output())))

        urls = wait_until_sync(lambda: len(metrics()) == 2 and metrics(), 30, "both processes listen")
        pids = _children(proc.popen.pid)
        _rename_in(tmp_path / "policy.yaml", "policy: least_load\n")
        proc.popen.send_signal(signal.SIGHUP)
        for url in urls:
            wait_until_sync(lambda url=url: _reloads(url, "applied") == 1.0, 20, f"{url} reloaded")
        assert proc.popen.poll() is None and _children(proc.popen.pid) == pids  # nothing restarted
        assert "asked to reload the policy" in proc.output() and _served(f"http://127.0.0.1:{port}")
    finally:
        proc.stop()


def _children(pid: int) -> set[int]:
    """The live gateway processes whose parent is `pid` (the nats-server it started aside)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"gateway.cli" in cmdline:
            out.add(int(entry.name))
    return out


def test_a_gateway_in_a_terminals_foreground_stops_on_its_hangup(tmp_path: Path, emulator: str) -> None:
    # Its stdin a terminal: SIGHUP is the terminal closing, and the gateway stops (drained, as on
    # SIGTERM) rather than stay in the background holding its port.
    config = _config(tmp_path, emulator, policy=True)
    port = free_port()
    leader, follower = pty.openpty()
    log_path = tmp_path / "gateway.log"
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)]
    argv += ["--metrics-port", "0"]
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(
            argv,
            cwd=REPO,
            stdin=follower,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "KVGATE_KEY_SECRET": SECRET.decode()},
        )
    os.close(follower)
    proc = Proc(popen, log_path)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc)
        popen.send_signal(signal.SIGHUP)
        assert popen.wait(timeout=60) == 0
        assert "SIGHUP: reloading" not in proc.output()
    finally:
        proc.stop()
        os.close(leader)
