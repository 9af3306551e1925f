"""The targets of `kvgate bench overhead` that are ours: the static backend, the backend reached
directly, and kvgate in front of it (one process, or `kvgate serve --processes N`). A target knows
how to start itself in front of a backend URL; the peers' targets are in `overhead_peers`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loadtest import static_backend
from loadtest.overhead_load import API_KEY, spawn, wait_ready
from loadtest.ports import free_port
from policies.identity import hash_api_key


@dataclass(frozen=True, slots=True)
class Target:
    """How to start a router in front of the backend; `start` returns (process, base URL) or raises."""

    name: str
    baseline: str | None
    start: Callable[[str, Path], tuple[subprocess.Popen[bytes] | None, str]]


class TargetMissing(RuntimeError):
    """The target cannot run here (not installed, not in this tree); the message says why."""


def start_backend(kind: str, workdir: Path, stream: bool = False) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    answers = "streamed chat, 16 deltas + usage" if stream else "JSON chat"
    if kind == "nginx":
        prefix = workdir / "nginx"
        prefix.mkdir(exist_ok=True)
        conf = prefix / "nginx.conf"
        conf.write_text(static_backend.nginx_config(str(prefix), port, stream=stream))
        proc = spawn(["nginx", "-c", str(conf), "-p", str(prefix)], workdir / "backend.log")
        name = f"nginx (1 worker process), {answers}"
    else:
        argv = [sys.executable, "-m", "loadtest.static_backend", "--port", str(port)]
        proc = spawn([*argv, "--stream"] if stream else argv, workdir / "backend.log")
        name = f"built-in static backend (loadtest.static_backend, 1 process), {answers}"
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", proc, workdir / "backend.log")
    return proc, url, name


BENCH_SECRET = "kvgate-bench-key-hash-secret-32-bytes"


def kvgate_config(backend: str, policy_path: Path, port: int, traced: bool = False) -> str:
    """The gateway config (schema of `gateway.config`) for one static worker and the bench key."""
    key_hash = hash_api_key(BENCH_SECRET.encode(), API_KEY)
    return json.dumps(
        {
            "listen": {"host": "127.0.0.1", "port": port},
            "metrics": {"listen": {"host": "127.0.0.1", "port": 0}},  # any free port: runs side by side
            "policy_file": str(policy_path),
            "log_level": "warning",
            "secrets": {"key_hash_secret_env": "KVGATE_KEY_SECRET"},
            "pools": [{"name": "bench", "models": [static_backend.MODEL], "workers": [backend]}],
            "tenants": [{"name": "bench", "api_key_hashes": [key_hash]}],
            "tracing": {"enabled": traced},
        }
    )


def _tracing_env(backend: str) -> dict[str, str]:
    """Spans exported over OTLP/HTTP to the static backend, which answers 200 to the POST as a
    collector would (its CPU is not the router's). Every request is sampled unless the caller's
    environment sets OTEL_TRACES_SAMPLER (and _ARG)."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": backend + "/v1/chat/completions",
        "OTEL_TRACES_SAMPLER": os.environ.get("OTEL_TRACES_SAMPLER", "always_on"),
    }


def kvgate_argv(config_path: Path, processes: int = 1) -> list[str]:
    """`kvgate serve`, or with more than one process `kvgate serve --processes N` (one port with
    SO_REUSEPORT, sharing through the nats-server that command starts)."""
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)]
    return [*argv, "--processes", str(processes)] if processes > 1 else argv


def kvgate_target(policy: str, baseline: str, traced: bool = False, processes: int = 1) -> Target:
    label = f"{policy} traced" if traced else policy
    if processes > 1:
        label = f"{label} x{processes} processes"
        baseline = f"kvgate {policy}"  # compared with one process of the same policy

    def start(backend: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        port = free_port()
        policy_path = workdir / f"policy-{label.replace(' ', '_')}.yaml"
        policy_path.write_text(f"policy: {policy}\nseed: 0\n")
        config_path = workdir / f"kvgate-{label.replace(' ', '_')}.yaml"
        config_path.write_text(kvgate_config(backend, policy_path, port, traced))
        log_path = workdir / f"kvgate-{label.replace(' ', '_')}.log"
        argv = kvgate_argv(config_path, processes)
        env = {"KVGATE_KEY_SECRET": BENCH_SECRET, **(_tracing_env(backend) if traced else {})}
        proc = spawn(argv, log_path, env=env)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/readyz", proc, log_path)
        return proc, url

    return Target(f"kvgate {label}", baseline, start)


def direct_target() -> Target:
    return Target("direct", None, lambda backend, workdir: (None, backend))
