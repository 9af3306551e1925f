"""The demo: emulated workers as child processes plus a built-in gateway config.

Children are started in their own sessions (so a signal to the gateway's terminal does not race
our own shutdown) with a parent-death signal on Linux, and always stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.auth import hash_api_key
from gateway.config import (
    ConfigError,
    DrainConfig,
    GatewayConfig,
    HealthConfig,
    ListenConfig,
    PoolConfig,
    SecretsConfig,
    TenantConfig,
)
from policies.base import Isolation, RoutingPolicy
from policies.config import PolicyConfig, build_policy

EMULATOR_MODULE = "loadtest.emulator"
_HEALTH_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Child:
    """A started worker process and where it listens."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    # Linux prctl(PR_SET_PDEATHSIG, SIGTERM): a killed gateway does not leave workers behind.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def start_child(argv: list[str], url: str, log_dir: Path, name: str) -> Child:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
    return Child(proc, url, log_path)


def stop_children(children: list[Child], timeout_s: float = 5.0) -> None:
    """SIGTERM each child's process group, then SIGKILL whatever is still alive."""
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()


def wait_healthy(children: list[Child], timeout_s: float = _HEALTH_WAIT_S) -> None:
    """Block until every child answers GET /health with 200; a child that exits is an error."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.proc.poll() is not None:
                tail = child.log_path.read_text(errors="replace")[-2000:]
                raise ConfigError(f"worker {child.url} exited with {child.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(child.url + "/health", timeout=1.0) as resp:
                    if resp.status == 200:
                        pending.remove(child)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            raise ConfigError(f"workers not healthy after {timeout_s:g} s: {[c.url for c in pending]}")
        if pending:
            time.sleep(0.1)


def demo_config(urls: list[str], key_hash: str, host: str, port: int) -> GatewayConfig:
    return GatewayConfig(
        listen=ListenConfig(host=host, port=port),
        drain=DrainConfig(shutdown_delay_s=0.0, deadline_s=5.0),
        secrets=SecretsConfig(key_hash_secret_env=None),
        pools=[
            PoolConfig(
                name="demo",
                models=["kvgate-demo"],
                workers=urls,
                health=HealthConfig(interval_s=1.0, timeout_s=1.0),
            )
        ],
        tenants=[TenantConfig(name="demo", api_key_hashes=[key_hash], isolation=Isolation.STRICT)],
    )


def demo_policy() -> RoutingPolicy:
    from gateway.serve import demo_policy_name

    return build_policy(PolicyConfig(policy=demo_policy_name()))


def run_demo(args: argparse.Namespace, serve: Callable[[GatewayConfig, bytes, RoutingPolicy], int]) -> int:
    if importlib.util.find_spec(EMULATOR_MODULE) is None:
        raise ConfigError(f"the demo needs the emulated worker ({EMULATOR_MODULE}), which is not installed")
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    host = args.host or "127.0.0.1"
    port = args.port if args.port is not None else 8080
    # A fresh secret per run: the demo key's hash is computed here, never stored.
    secret = secrets.token_bytes(32)
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-demo-") as log_dir:
        try:
            for i in range(args.workers):
                wport = free_port()
                argv = [
                    sys.executable,
                    "-m",
                    EMULATOR_MODULE,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(wport),
                    "--model",
                    "kvgate-demo",
                    "--seed",
                    str(i),
                ]
                children.append(start_child(argv, f"http://127.0.0.1:{wport}", Path(log_dir), f"worker{i}"))
            wait_healthy(children)
            config = demo_config([c.url for c in children], hash_api_key(secret, args.demo_key), host, port)
            policy = demo_policy()
            print(
                f"kvgate demo: {len(children)} emulated workers, policy {getattr(policy, 'name', '?')}\n"
                f"  base URL: http://{host}:{port}/v1\n"
                f"  API key:  {args.demo_key}\n"
                f"  model:    kvgate-demo\n"
                "Ctrl-C stops the gateway and every worker.",
                flush=True,
            )
            return serve(config, secret, policy)
        finally:
            stop_children(children)
