"""`kvgate serve --processes 2`: a second SIGINT (a second Ctrl-C) while the processes drain kills
them and the supervisor exits, as one process does; it used to wait for the whole drain."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.e2e.harness import (
    SECRET,
    alive,
    gateway_processes,
    serving_processes,
)
from tests.support.gateway_config import idle_gateway_config
from tests.support.wait import wait_until_sync


def test_a_second_sigint_while_draining_stops_at_once(tmp_path: Path) -> None:
    # The processes keep listening for 10 minutes after the first signal: only a kill ends them.
    config = idle_gateway_config(
        tmp_path / "gw.yaml",
        "sk-e2e-second-signal-0123456789abcdef",
        drain={"shutdown_delay_s": 600, "deadline_s": 600},
    )
    env = {"KVGATE_KEY_SECRET": SECRET.decode()}
    with serving_processes("--config", str(config), env=env) as (_, proc):
        supervisor = proc.popen.pid
        gateways = gateway_processes(supervisor)
        assert len(gateways) == 2
        os.kill(supervisor, signal.SIGINT)
        # Draining: every process runs on (its readiness 503).
        wait_until_sync(lambda: proc.output().count('"msg":"draining"') >= 2, 30, "both processes drain")
        assert proc.popen.poll() is None and all(alive(p) for p in gateways)
        os.kill(supervisor, signal.SIGINT)
        wait_until_sync(lambda: proc.popen.poll() is not None, 60, "the supervisor exits")
        assert "second signal: killing the gateway processes" in proc.output()
        assert not any(alive(p) for p in gateways)
