"""`kvgate serve --processes 2` without a `sync.url` runs a local nats-server; when it dies, the
supervisor reaps it and starts it again on the same port and token, and the processes reconnect
(before, it stayed a zombie and each process counted quotas alone until the group restarted)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx

from tests.e2e.harness import (
    SECRET,
    broker_processes,
    metrics_urls,
    serving_processes,
)
from tests.support.gateway_config import idle_gateway_config
from tests.support.wait import wait_until_sync


def _connected(metrics_url: str) -> bool:
    text = httpx.get(metrics_url, timeout=5).text
    found = re.search(r"^kvgate_sync_connected (\S+)", text, re.MULTILINE)
    return found is not None and float(found.group(1)) == 1.0


def test_a_dead_local_broker_is_started_again(tmp_path: Path) -> None:
    config = idle_gateway_config(tmp_path / "gw.yaml", "sk-e2e-broker-0123456789abcdef")
    env = {"KVGATE_KEY_SECRET": SECRET.decode()}
    with serving_processes("--config", str(config), env=env) as (_, proc):
        supervisor = proc.popen.pid
        urls = sorted(set(metrics_urls(proc)))
        wait_until_sync(lambda: all(_connected(u) for u in urls), 30, "both processes joined the broker")
        (first,) = broker_processes(supervisor)
        os.kill(first, signal.SIGKILL)

        def restarted() -> set[int]:
            assert proc.popen.poll() is None, proc.output()[-3000:]
            return broker_processes(supervisor) - {first}

        wait_until_sync(restarted, 30, "a new nats-server runs")
        assert not Path(f"/proc/{first}").exists()  # reaped, not left a zombie
        assert f"the local nats-server (pid {first}) exited with -9; starting it again" in proc.output()
        # The processes reconnect by themselves, with the run's token.
        wait_until_sync(lambda: all(_connected(u) for u in urls), 60, "both processes reconnected")
        assert proc.stop() == 0
