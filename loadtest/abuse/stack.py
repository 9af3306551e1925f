"""The processes the suite runs against, all on loopback and free ports, all stopped by PID.

- three emulated vLLM workers (`python -m loadtest.emulator`) in pool `main`, serving `MODEL`,
  and one more alone in pool `solo` (`SOLO_MODEL`), where every request meets every other
  request's KV: the cross-tenant probe needs that;
- one faulty-worker process (`loadtest.abuse.faulty_worker`) with a port that answers garbage
  (pool `garbage`) and a port that never answers beside one that does (pool `hung`);
- the gateway, `kvgate serve --config` (run as `python -m gateway.cli`), with its metrics on a
  listener of their own (`--metrics-port`), the admin API on, and the tenants: `tenant-a`
  (`max_concurrent` 3) and `tenant-b` (no quota) whom the probes set against each other, and
  `metered` (a tpm quota) for the quota probe alone. One client address may hold at most
  `ADDRESS_LIMIT` connections.

The policy file holds a volatile rule with a pattern that backtracks catastrophically under
Python's `re`, and a small prefix index, so that the regex and flood probes have something to
push against.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.abuse.settings import Sizes
from loadtest.peers.launch import RunningProcess, wait_http_ready
from loadtest.ports import free_ports
from policies.identity import hash_api_key

MODEL = "emulated-llama"
GARBAGE_MODEL = "garbage-model"
HUNG_MODEL = "hung-model"
SOLO_MODEL = "solo-llama"
SECRET = "kvgate-abuse-key-hash-secret-32-bytes"
KEY_A, KEY_B, KEY_METERED, KEY_ADMIN = "sk-abuse-a", "sk-abuse-b", "sk-abuse-metered", "sk-abuse-admin"
TENANT_A_CONCURRENCY = 3
MAX_IN_FLIGHT = 64  # gateway-wide: tenant A's partial bodies alone could fill it under the old order
# Connections one client address may hold: above what the suite opens from 127.0.0.1 at once (the
# soak holds at most 256 requests open), so that only the probe that opens connections from
# another loopback address meets it.
ADDRESS_LIMIT = 512
TPM = 3000
INDEX_MAX_ENTRIES = 3000
NAMESPACE_SHARE = 0.5
READ_TIMEOUT_S = 3.0  # pool main: a stopped worker is given up this soon
HUNG_READ_TIMEOUT_S = 1.0
BACKTRACKING_PATTERN = r"Session: (\w+\s?)+;"
WORKERS = 3
READY_TIMEOUT_S = 60.0


def policy_document(volatile_pattern: str = BACKTRACKING_PATTERN) -> dict[str, Any]:
    """The policy file: `cost`, a small index, and one volatile rule with `volatile_pattern`."""
    return {
        "policy": "cost",
        "seed": 7,
        "default_pool": {"index": {"max_entries": INDEX_MAX_ENTRIES, "namespace_share": NAMESPACE_SHARE}},
        "normalizer": {
            "mode": "approximate",
            "volatile_rules": [
                {"name": "session", "pattern": volatile_pattern, "roles": ["user"], "action": "move_to_end"}
            ],
        },
    }


def _gateway_document(
    port: int, sizes: Sizes, main: list[str], solo: str, garbage: str, hang: str, ok: str
) -> dict[str, Any]:
    secret = SECRET.encode()
    quick_health = {"interval_s": 0.5, "timeout_s": 1.0, "failures_to_down": 2}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "info",  # one access line per request: the probes read statuses from it
        "limits": {
            "max_in_flight_requests": MAX_IN_FLIGHT,
            "header_timeout_s": sizes.header_timeout_s,
            "body_timeout_s": sizes.body_timeout_s,
            "max_client_connections_per_address": ADDRESS_LIMIT,
        },
        "drain": {"shutdown_delay_s": 0, "deadline_s": 30},
        "admin": {"api_key_hash": hash_api_key(secret, KEY_ADMIN)},
        "policy_file": "policy.yaml",
        "policy_reload_interval_s": 1.0,
        "pools": [
            {
                "name": "main",
                "models": [MODEL],
                "workers": main,
                "timeouts": {"connect_s": 1.0, "read_s": READ_TIMEOUT_S, "total_s": 120.0},
                "health": quick_health,
                "breaker": {"failure_threshold": 3, "cooldown_s": 2.0},
            },
            {"name": "solo", "models": [SOLO_MODEL], "workers": [solo], "health": quick_health},
            {
                "name": "garbage",
                "models": [GARBAGE_MODEL],
                "workers": [garbage],
                "retry_attempts": 0,
                "health": quick_health,
                "breaker": {"failure_threshold": 2, "cooldown_s": 600.0},
            },
            {
                "name": "hung",
                "models": [HUNG_MODEL],
                "workers": [hang, ok],
                "timeouts": {"connect_s": 1.0, "read_s": HUNG_READ_TIMEOUT_S, "total_s": 60.0},
                "health": quick_health,
                "breaker": {"failure_threshold": 2, "cooldown_s": 600.0},
            },
        ],
        "tenants": [
            {
                "name": "tenant-a",
                "api_key_hashes": [hash_api_key(secret, KEY_A)],
                "quotas": {"max_concurrent": TENANT_A_CONCURRENCY},
            },
            {"name": "tenant-b", "api_key_hashes": [hash_api_key(secret, KEY_B)]},
            {
                "name": "metered",
                "api_key_hashes": [hash_api_key(secret, KEY_METERED)],
                "quotas": {"tpm": TPM},
            },
        ],
    }


@dataclass
class Worker:
    """One emulated worker: its port stays its own across restarts, so the gateway sees the same
    URL come back."""

    index: int
    port: int
    workdir: Path
    model: str = MODEL
    proc: RunningProcess | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.proc.pid

    def start(self) -> None:
        argv = [sys.executable, "-m", "loadtest.emulator", "--port", str(self.port), "--model", self.model]
        argv += ["--seed", str(self.index)]
        log = self.workdir / f"worker{self.index}.{self.starts}.log"
        self.proc = RunningProcess(argv, log_path=log)
        self.starts += 1
        wait_http_ready(self.url + "/health", self.proc, READY_TIMEOUT_S)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait_exit(self, timeout_s: float) -> int:
        """Wait for the process to end (after a signal) and close its log."""
        assert self.proc is not None
        code = self.proc.proc.wait(timeout_s)
        self.proc.stop()
        return code

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.proc.poll() is None:
                os.kill(self.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
            self.proc.stop()


@dataclass
class Stack:
    """Every process of one run; `stop()` ends them all, whatever state a probe left them in."""

    workdir: Path
    sizes: Sizes
    port: int
    metrics_port: int
    workers: list[Worker]
    solo: Worker
    faulty_ports: dict[str, int]
    faulty: RunningProcess | None = None
    gateway: RunningProcess | None = None
    config_path: Path = field(default=Path())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def gateway_pid(self) -> int:
        assert self.gateway is not None
        return self.gateway.proc.pid

    @property
    def gateway_log(self) -> Path:
        return self.workdir / "gateway.log"

    @property
    def policy_path(self) -> Path:
        return self.workdir / "policy.yaml"

    def faulty_url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.faulty_ports[mode]}"

    def gateway_exit_code(self, timeout_s: float) -> int | None:
        """The gateway's exit status once it ends within `timeout_s`, else None."""
        assert self.gateway is not None
        try:
            return self.gateway.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop(timeout_s=40.0)  # beyond the drain deadline
        for worker in [*self.workers, self.solo]:
            worker.stop()
        if self.faulty is not None:
            self.faulty.stop()


def start_stack(workdir: Path, sizes: Sizes) -> Stack:
    """Start the workers, then the gateway; on any failure stop what was started and re-raise."""
    workdir.mkdir(parents=True, exist_ok=True)
    modes = ("garbage", "hang", "ok")
    port, metrics_port, *ports = free_ports(2 + WORKERS + 1 + len(modes))
    stack = Stack(
        workdir,
        sizes,
        port,
        metrics_port,
        [Worker(i, ports[i], workdir) for i in range(WORKERS)],
        Worker(WORKERS, ports[WORKERS], workdir, SOLO_MODEL),
        dict(zip(modes, ports[WORKERS + 1 :], strict=True)),
    )
    try:
        argv = [sys.executable, "-m", "loadtest.abuse.faulty_worker"]
        for mode, port in stack.faulty_ports.items():
            argv += ["--listen", f"{port}:{mode}"]
        stack.faulty = RunningProcess(argv, log_path=workdir / "faulty.log")
        for worker in [*stack.workers, stack.solo]:
            worker.start()
        for mode in stack.faulty_ports:
            wait_http_ready(stack.faulty_url(mode) + "/health", stack.faulty, READY_TIMEOUT_S)
        stack.policy_path.write_text(yaml.safe_dump(policy_document(), sort_keys=False))
        document = _gateway_document(
            stack.port,
            sizes,
            [w.url for w in stack.workers],
            stack.solo.url,
            stack.faulty_url("garbage"),
            stack.faulty_url("hang"),
            stack.faulty_url("ok"),
        )
        stack.config_path = workdir / "gateway.yaml"
        stack.config_path.write_text(yaml.safe_dump(document, sort_keys=False))
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(stack.config_path)]
        argv += ["--metrics-port", str(stack.metrics_port)]
        stack.gateway = RunningProcess(argv, env={"KVGATE_KEY_SECRET": SECRET}, log_path=stack.gateway_log)
        wait_http_ready(stack.base_url + "/readyz", stack.gateway, READY_TIMEOUT_S)
    except BaseException:
        stack.stop()
        raise
    return stack
