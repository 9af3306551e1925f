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
from typing import Any

from gateway.auth import hash_api_key
from gateway.config import DrainConfig, GatewayConfig, SecretsConfig, TenantConfig, parse_config
from gateway.config.base import ConfigError
from gateway.config.pd import PdConfig
from gateway.config.pool import HealthConfig, PoolConfig
from gateway.policy_watch import LoadedPolicy
from policies.base import Isolation
from policies.config import PolicyConfig, build_policy
from policies.pd import HOLDER_PREFILL

EMULATOR_MODULE = "loadtest.emulator"
_HEALTH_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Child:
    """A started worker process and where it listens."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path


@dataclass(frozen=True, slots=True)
class DemoWorker:
    """One emulated worker to start: its role and, for an SGLang prefill worker, its bootstrap port."""

    name: str
    role: str = "mixed"
    bootstrap_port: int | None = None
    sglang: bool = False  # a decode worker then refuses requests not paired, as SGLang's does

    def argv(self, port: int, seed: int) -> list[str]:
        argv = [sys.executable, "-m", EMULATOR_MODULE, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--model", "kvgate-demo", "--seed", str(seed)]
        if self.role != "mixed":
            argv += ["--role", self.role, "--kv-engine-id", self.name]
        if self.sglang:
            argv += ["--pd-protocol", "sglang"]
        if self.bootstrap_port is not None:
            argv += ["--bootstrap-port", str(self.bootstrap_port)]
        return argv


def demo_workers(args: argparse.Namespace) -> list[DemoWorker]:
    """The workers `--workers N` or `--pd P:D` (with `--pd-protocol`) ask for; `--pd
    holder_prefill` keeps `--workers N` mixed ones (vLLM's protocol only)."""
    if args.pd == HOLDER_PREFILL and args.pd_protocol != "vllm":
        raise ConfigError("--pd holder_prefill needs --pd-protocol vllm")
    if args.pd is None or args.pd == HOLDER_PREFILL:
        if args.workers < 1:
            raise ConfigError("--workers must be at least 1")
        return [DemoWorker(f"worker{i}") for i in range(args.workers)]
    try:
        n_prefill, n_decode = (int(part) for part in args.pd.split(":"))
    except ValueError:
        raise ConfigError(
            f"--pd takes P:D, two worker counts (e.g. 1:1), or holder_prefill, not {args.pd!r}"
        ) from None
    if n_prefill < 1 or n_decode < 1:
        raise ConfigError("--pd needs at least one prefill and one decode worker")
    boots = free_ports_except(n_prefill, _gateway_ports(args)) if args.pd_protocol == "sglang" else []
    prefill = [DemoWorker(f"prefill{i}", "prefill", boots[i] if boots else None) for i in range(n_prefill)]
    sglang = args.pd_protocol == "sglang"
    return [*prefill, *(DemoWorker(f"decode{i}", "decode", sglang=sglang) for i in range(n_decode))]


PORT_SHARD_ENV = "KVGATE_PORT_SHARD"
_PORT_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, the kernel's pick. With `KVGATE_PORT_SHARD=i/n` (set by
    runs side by side on one host, see `loadtest/ports.py`) only a port whose half is congruent to
    i modulo n, so that two runs never pick the same port between picking and binding it."""
    value = os.environ.get(PORT_SHARD_ENV) or "0/1"
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ConfigError(f"{PORT_SHARD_ENV} must be i/n with 0 <= i < n, not {value!r}")
    shard, shards = int(index), int(count)
    with contextlib.ExitStack() as held:
        for _ in range(_PORT_TRIES * shards):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            if port // 2 % shards == shard:
                return port
    raise OSError(f"no free port on {host} in shard {shard}/{shards}")


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


def demo_config(
    urls: list[str],
    key_hash: str,
    host: str,
    port: int,
    workers: list[DemoWorker] | None = None,
    pd_protocol: str = "vllm",
    holder_prefill: bool = False,
    metrics_port: int | None = None,
) -> GatewayConfig:
    """The demo's gateway config; with P/D `workers` (in the order of `urls`), a P/D pool; with
    `holder_prefill`, mixed workers in that pd mode. What comes from the command line (the ports,
    the host) is checked as a config file's would be (`ConfigError`)."""
    roles = {url: w for url, w in zip(urls, workers or [], strict=False)}
    pd = any(w.role != "mixed" for w in roles.values())
    pool = PoolConfig(
        name="demo",
        models=["kvgate-demo"],
        workers=[u for u in urls if not pd or roles[u].role == "mixed"],
        prefill_workers=[u for u in urls if pd and roles[u].role == "prefill"],
        decode_workers=[u for u in urls if pd and roles[u].role == "decode"],
        pd=PdConfig(
            protocol="sglang" if pd_protocol == "sglang" else "vllm",
            bootstrap_ports={u: w.bootstrap_port for u, w in roles.items() if w.bootstrap_port is not None},
        )
        if pd
        else PdConfig(mode=HOLDER_PREFILL)
        if holder_prefill
        else None,
        health=HealthConfig(interval_s=1.0, timeout_s=1.0),
    )
    raw: dict[str, Any] = {
        "listen": {"host": host, "port": port},
        "drain": DrainConfig(shutdown_delay_s=0.0, deadline_s=5.0),
        "secrets": SecretsConfig(key_hash_secret_env=None),
        "pools": [pool],
        "tenants": [TenantConfig(name="demo", api_key_hashes=[key_hash], isolation=Isolation.STRICT)],
    }
    if metrics_port is not None:
        raw["metrics"] = {"listen": {"port": metrics_port}}
    return parse_config(raw)


def demo_policy() -> LoadedPolicy:
    from gateway.serve import demo_policy_name

    config = PolicyConfig(policy=demo_policy_name())
    return LoadedPolicy(build_policy(config), config, "")


def _gateway_ports(args: argparse.Namespace) -> set[int]:
    """The ports the gateway will listen on: the client port and the metrics ports (with
    `--processes N`, N of them from `--metrics-port`)."""
    first = args.metrics_port or 0
    metrics = range(first, first + getattr(args, "processes", 1)) if first else range(0)
    return {args.port or 8080, *metrics}


def free_ports_except(count: int, taken: set[int]) -> list[int]:
    """`count` distinct free ports, none of them in `taken`: ports already promised to a listener
    that has not bound them yet (the gateway's own, while the demo's workers start before it; a
    worker there would leave the gateway unable to bind it)."""
    ports: list[int] = []
    taken = set(taken)
    while len(ports) < count:
        if (port := free_port()) not in taken:
            ports.append(port)
            taken.add(port)
    return ports


def run_demo(args: argparse.Namespace, serve: Callable[[GatewayConfig, bytes, LoadedPolicy], int]) -> int:
    if importlib.util.find_spec(EMULATOR_MODULE) is None:
        raise ConfigError(f"the demo needs the emulated worker ({EMULATOR_MODULE}), which is not installed")
    workers = demo_workers(args)
    host = args.host or "127.0.0.1"
    port = args.port if args.port is not None else 8080
    # A fresh secret per run: the demo key's hash is computed here, never stored.
    secret = secrets.token_bytes(32)
    # The workers' ports are chosen first so that the whole config is checked before any starts.
    boots = {w.bootstrap_port for w in workers if w.bootstrap_port is not None}
    ports = free_ports_except(len(workers), boots | _gateway_ports(args))
    urls = [f"http://127.0.0.1:{wport}" for wport in ports]
    key_hash = hash_api_key(secret, args.demo_key)
    holder = args.pd == HOLDER_PREFILL
    config = demo_config(urls, key_hash, host, port, workers, args.pd_protocol, holder, args.metrics_port)
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-demo-") as log_dir:
        try:
            for i, (worker, wport, url) in enumerate(zip(workers, ports, urls, strict=True)):
                children.append(start_child(worker.argv(wport, i), url, Path(log_dir), worker.name))
            wait_healthy(children)
            policy = demo_policy()
            described = _describe(workers, args.pd_protocol) + (", pd.mode holder_prefill" if holder else "")
            print(
                f"kvgate demo: {described}, policy {policy.config.policy}\n"
                f"  base URL: http://{host}:{port}/v1\n"
                f"  API key:  {args.demo_key}\n"
                f"  model:    kvgate-demo\n"
                "Ctrl-C stops the gateway and every worker.",
                flush=True,
            )
            return serve(config, secret, policy)
        finally:
            stop_children(children)


def _describe(workers: list[DemoWorker], protocol: str) -> str:
    n_prefill = sum(w.role == "prefill" for w in workers)
    if n_prefill == 0:
        return f"{len(workers)} emulated workers"
    n_decode = len(workers) - n_prefill
    return f"{n_prefill} prefill + {n_decode} decode emulated workers ({protocol} P/D protocol)"
