"""Real processes on 127.0.0.1 for end-to-end tests: start in their own process group, wait until
ready, always stop by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.auth import hash_api_key

REPO = Path(__file__).resolve().parents[2]
SECRET = b"e2e-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Proc:
    """A started process and its combined output file."""

    popen: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


def start(argv: list[str], env: dict[str, str] | None = None) -> Proc:
    fd, name = tempfile.mkstemp(prefix="kvgate-e2e-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:
        popen = subprocess.Popen(
            argv,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return Proc(popen, Path(name))


def wait_http(url: str, proc: Proc, timeout_s: float = 20.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"process exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == status:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s} s:\n{proc.output()[-3000:]}")


def start_fake_workers(modes: dict[int, str]) -> Proc:
    argv = [sys.executable, "-m", "tests.e2e.fake_worker"]
    for port, mode in modes.items():
        argv += ["--listen", f"{port}:{mode}"]
    proc = start(argv)
    for port in modes:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
    return proc


def write_gateway_config(
    path: Path, pools: list[dict[str, Any]], tenants: list[dict[str, Any]], **extra: Any
) -> Path:
    config = {"pools": pools, "tenants": tenants, **extra}
    path.write_text(yaml.safe_dump(config))
    return path


def tenant(name: str, key: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "api_key_hashes": [hash_api_key(SECRET, key)], **extra}


def start_gateway(config_path: Path, port: int, metrics_port: int = 0) -> Proc:
    """A gateway on `port`, its /metrics on `metrics_port` (0: any free port, for tests that do not
    read metrics; never the fixed default, which gateways started side by side would share)."""
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port)]
    proc = start(argv, env={"KVGATE_KEY_SECRET": SECRET.decode()})
    wait_http(f"http://127.0.0.1:{port}/readyz", proc)
    return proc
