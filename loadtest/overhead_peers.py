"""The peer routers as targets of `kvgate bench overhead`: sglang-router and smg from their own
venvs (`loadtest/peers/install.sh`), and the minimal FastAPI pass-through proxies that compare
upstream HTTP clients. A peer that is not installed raises `TargetMissing` with the install command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loadtest.overhead_load import spawn, wait_ready
from loadtest.overhead_targets import Target, TargetMissing
from loadtest.peers.launch import peer_bin, smg_argv
from loadtest.ports import free_port


def _sglang_python() -> Path:
    base = Path(os.environ.get("KVGATE_PEERS_DIR", str(Path.home() / ".cache/kvgate/peers")))
    return base / "sglang-router" / "bin" / "python"


def sglang_target(policy: str) -> Target:
    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        python = _sglang_python()
        if not python.exists():
            raise TargetMissing(
                f"sglang-router not installed ({python}): run loadtest/peers/install.sh sglang-router"
            )
        port, metrics_port = free_port(), free_port()
        argv = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", backend, "--policy", policy, "--log-level", "warn"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        log_path = workdir / f"sglang-{policy}.log"
        proc = spawn(argv, log_path)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", proc, log_path)
        return proc, url

    return Target(f"sglang-router {policy}", None, start)


def smg_target(policy: str) -> Target:
    """smg 1.13 (`smg launch`), ready once its worker is registered and healthy."""

    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        exe = peer_bin("smg", "smg")
        if not exe.exists():
            raise TargetMissing(f"smg not installed ({exe}): run loadtest/peers/install.sh smg")
        port, metrics_port = free_port(), free_port()
        log_path = workdir / f"smg-{policy}.log"
        proc = spawn(list(smg_argv(str(exe), port, metrics_port, [backend], policy)), log_path)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/readiness", proc, log_path)
        return proc, url

    return Target(f"smg {policy}", "sglang-router cache_aware", start)


def proxy_target(client: str) -> Target:
    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        port = free_port()
        argv = [sys.executable, "-m", "loadtest.overhead_load", "--child-proxy", client]
        argv += ["--port", str(port), "--upstream", backend]
        log_path = workdir / f"proxy-{client}.log"
        proc = spawn(argv, log_path)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", proc, log_path)
        return proc, url

    return Target(f"pass-through FastAPI + {client}", "sglang-router round_robin", start)
