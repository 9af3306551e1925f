"""`kvgate serve --processes N` on a port something already listens on stops with the single
process's message and exit code 2: a plain listener (it used to raise a traceback), or another
group's processes (SO_REUSEPORT used to let the second group join the first silently, the kernel
sharing the port's connections between two gateways)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from tests.e2e.harness import SECRET, free_port, serving_processes, start
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
