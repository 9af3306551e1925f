"""`kvgate serve --processes N` on a port something already listens on stops with the single
process's message and exit code 2: a plain listener (it used to raise a traceback), or another
group's processes (SO_REUSEPORT used to let the second group join the first silently, the kernel
sharing the port's connections between two gateways), even at an instant when none of the other
group's processes listens (all of them restarting: that second group used to start)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from tests.e2e.harness import SECRET, alive, free_port, gateway_processes, serving_processes, start
from tests.support.gateway_config import idle_gateway_config
from tests.support.wait import wait_until_sync

ENV = {"KVGATE_KEY_SECRET": SECRET.decode()}


def _config(tmp_path: Path) -> Path:
    return idle_gateway_config(tmp_path / "gw.yaml", "sk-e2e-port-0123456789abcdef")


def _serve(config: Path, port: int) -> tuple[int, str]:
    argv = [
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--processes", "2",
        "--port", str(port), "--metrics-port", "0",
    ]  # fmt: skip
    proc = start(argv, env=ENV)
    try:
        wait_until_sync(lambda: proc.popen.poll() is not None, 60, "the second start stops")
    finally:
        code = proc.stop()
    return code, proc.output()


def test_a_port_another_program_listens_on(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        code, out = _serve(_config(tmp_path), port)
    assert code == 2, out
    assert f"kvgate serve: listen: cannot listen on 127.0.0.1:{port}: Address already in use" in out
    assert "Traceback" not in out


def test_a_port_another_group_serves(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with serving_processes("--config", str(config), env=ENV) as (base, first):
        port = int(base.rsplit(":", 1)[1])
        code, out = _serve(config, port)
        assert first.popen.poll() is None
    assert code == 2, out
    assert f"kvgate serve: listen: cannot listen on 127.0.0.1:{port}: Address already in use" in out
    assert "gateway processes on" not in out


def _refused(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_port_whose_group_is_restarting_every_process(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with serving_processes("--config", str(config), env=ENV) as (base, first):
        port = int(base.rsplit(":", 1)[1])
        children = gateway_processes(first.popen.pid)
        assert len(children) == 2
        # The supervisor stopped between its children's exit and their restart: nothing listens.
        os.kill(first.popen.pid, signal.SIGSTOP)
        try:
            for child in children:
                os.kill(child, signal.SIGKILL)
            wait_until_sync(lambda: not any(map(alive, children)) and _refused(port), 30, "nothing listens")
            code, out = _serve(config, port)
        finally:
            os.kill(first.popen.pid, signal.SIGCONT)
        assert first.popen.poll() is None
    assert code == 2, out
    assert f"kvgate serve: listen: cannot listen on 127.0.0.1:{port}: Address already in use" in out
    assert "gateway processes on" not in out
