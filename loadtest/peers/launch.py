"""Start and stop one peer router in front of given worker URLs.

Peers live in their own venvs (see `install.sh`). A peer that is not installed raises `PeerMissing`
with the install command; the benchmark reports it as missing rather than skipping it quietly.
Commands follow what was verified on this machine: loopback only, distinct router and Prometheus
ports, quiet log levels (sglang-router logs every request at info), no `model_path` advertised by
the workers (else sglang-router tries a tokenizer download), smg's tokenizer autoload off, and
LiteLLM's cost map kept local.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

PEERS = ("sglang-router", "vllm-router", "litellm", "smg")
DEFAULT_POLICY = {
    "sglang-router": "cache_aware",
    "vllm-router": "cache_aware",
    "litellm": "simple-shuffle",
    "smg": "cache_aware",
}
LITELLM_MASTER_KEY = "sk-kvgate-bench"


class PeerMissing(RuntimeError):
    """The peer's venv is not installed."""


def peers_dir() -> Path:
    return Path(os.environ.get("KVGATE_PEERS_DIR", str(Path.home() / ".cache/kvgate/peers")))


def peer_bin(name: str, program: str) -> Path:
    return peers_dir() / name / "bin" / program


def _program(name: str) -> str:
    return {"sglang-router": "python", "vllm-router": "vllm-router", "litellm": "litellm", "smg": "smg"}[name]


def is_installed(name: str) -> bool:
    return peer_bin(name, _program(name)).is_file() and os.access(peer_bin(name, _program(name)), os.X_OK)


@dataclass(frozen=True, slots=True)
class PeerCommand:
    """Everything needed to start a peer: argv, extra environment, an optional config file, readiness."""

    name: str
    policy: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    config_path: Path | None = None
    config_text: str | None = None
    ready_path: str = "/health"
    api_key: str | None = None
    port: int = 0


def build_command(
    name: str,
    *,
    port: int,
    metrics_port: int,
    worker_urls: Sequence[str],
    model: str,
    policy: str | None = None,
    workdir: Path,
) -> PeerCommand:
    """The command line for peer `name`; `PeerMissing` when it is not installed, `ValueError` if unknown."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    if not is_installed(name):
        raise PeerMissing(
            f"{name} is not installed under {peers_dir()}: run loadtest/peers/install.sh {name}"
        )
    policy = policy or DEFAULT_POLICY[name]
    exe = str(peer_bin(name, _program(name)))
    urls = list(worker_urls)
    if name == "sglang-router":
        argv = [exe, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *urls, "--policy", policy]
        argv += [
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            "warn",
        ]
        return PeerCommand(name, policy, tuple(argv), port=port)
    if name == "smg":
        return PeerCommand(name, policy, smg_argv(exe, port, metrics_port, urls, policy), port=port)
    if name == "vllm-router":
        argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        argv += ["--log-level", "warning"]
        return PeerCommand(name, policy, tuple(argv), port=port)
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": f"{u.rstrip('/')}/v1",
                    "api_key": "none",
                },
            }
            for u in urls
        ],
        "router_settings": {"routing_strategy": policy, "num_retries": 0},
        "litellm_settings": {"drop_params": True, "telemetry": False, "request_timeout": 120},
        "general_settings": {"master_key": LITELLM_MASTER_KEY},
    }
    config_path = workdir / "litellm_config.yaml"
    argv = [
        exe,
        "--config",
        str(config_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "DISABLE_ADMIN_UI": "True",
    }
    return PeerCommand(
        name,
        policy,
        tuple(argv),
        env,
        config_path,
        yaml.safe_dump(config, sort_keys=False),
        ready_path="/health/liveliness",
        api_key=LITELLM_MASTER_KEY,
        port=port,
    )


def smg_argv(
    exe: str, port: int, metrics_port: int, worker_urls: Sequence[str], policy: str
) -> tuple[str, ...]:
    """smg 1.13 in router-only mode (`smg launch`) in front of HTTP workers.

    `--disable-tokenizer-autoload`: the workers advertise a model name, not a local tokenizer
    directory, and nothing may be fetched from the Hub. Over HTTP smg's cache_aware routes on its
    approximate text tree; its event-driven KV index takes events only from gRPC workers (the
    `SubscribeKvEvents` RPC), so the emulated workers' vLLM ZMQ events cannot reach it.
    """
    argv = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls]
    argv += ["--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    argv += ["--log-level", "warn", "--disable-tokenizer-autoload"]
    return tuple(argv)


def build_smg_pd_command(
    *,
    port: int,
    metrics_port: int,
    prefill: Sequence[tuple[str, int]],
    decode_urls: Sequence[str],
    prefill_policy: str,
    decode_policy: str,
) -> PeerCommand:
    """smg 1.13 `--pd-disaggregation` in front of HTTP prefill workers (URL, bootstrap port) and
    decode workers; `PeerMissing` when smg is not installed. The workers must then be registered
    as SGLang runtimes (`register_smg_sglang_workers`) before smg sends `bootstrap_*`."""
    if not is_installed("smg"):
        raise PeerMissing(f"smg is not installed under {peers_dir()}: run loadtest/peers/install.sh smg")
    exe = str(peer_bin("smg", "smg"))
    argv = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation"]
    for url, boot in prefill:
        argv += ["--prefill", url, str(boot)]
    for url in decode_urls:
        argv += ["--decode", url]
    argv += ["--prefill-policy", prefill_policy, "--decode-policy", decode_policy]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    argv += ["--log-level", "warn", "--disable-tokenizer-autoload"]
    return PeerCommand("smg", prefill_policy, tuple(argv), port=port)


def _json(method: str, url: str, body: object | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5.0) as resp:
        return json.loads(resp.read() or b"null")


def register_smg_sglang_workers(
    base_url: str, bootstrap_ports: dict[str, int], timeout_s: float = 30.0
) -> None:
    """Re-register every worker of a P/D smg as an SGLang runtime, keeping its role and bootstrap port.

    smg 1.13 records HTTP workers given on its command line as vLLM runtimes with an unknown KV
    connector and then only forwards the prefill leg (docs/pd.md, "smg --pd-disaggregation");
    `PUT /workers/{id}` with `runtime_type: sglang` makes it inject `bootstrap_*` and send both
    legs at once. The PUT replaces the worker's settings, so the role and port are sent again.
    Waits until every worker reads back as a ready SGLang worker of its role."""
    workers = _json("GET", base_url + "/workers")["workers"]
    for w in workers:
        body: dict[str, object] = {"url": w["url"], "runtime_type": "sglang", "worker_type": w["worker_type"]}
        if w["url"] in bootstrap_ports:
            body["bootstrap_port"] = bootstrap_ports[w["url"]]
        _json("PUT", f"{base_url}/workers/{w['id']}", body)
    want = {w["url"]: w["worker_type"] for w in workers}
    deadline = time.monotonic() + timeout_s
    while True:
        now = {w["url"]: w for w in _json("GET", base_url + "/workers")["workers"]}
        if all(
            u in now
            and now[u].get("runtime_type") == "sglang"
            and now[u].get("worker_type") == role
            and now[u].get("status") == "ready"
            for u, role in want.items()
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"smg did not take the SGLang registration within {timeout_s:.0f}s")
        time.sleep(0.1)


class RunningProcess:
    """A child process in its own process group, stopped by PID (the whole group)."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, log_path: Path) -> None:
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(
            list(argv), stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        self.log_path = log_path

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
        self._log.close()

    def log_tail(self, n_bytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace")
        except OSError:
            return ""


def wait_http_ready(url: str, proc: RunningProcess, timeout_s: float) -> None:
    """Poll `url` until it answers 2xx; fail fast if the process exits, with its log tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.proc.returncode} before ready: {proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if 200 <= resp.status < 300:
                    return
        except (urllib.error.URLError, OSError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s: {proc.log_tail()}")


def start_peer(cmd: PeerCommand, *, workdir: Path, ready_timeout_s: float = 60.0) -> RunningProcess:
    """Start a peer and wait until it answers its readiness path; stops it again on failure."""
    if cmd.config_path is not None and cmd.config_text is not None:
        cmd.config_path.write_text(cmd.config_text)
    proc = RunningProcess(cmd.argv, env=cmd.env, log_path=workdir / f"{cmd.name.replace(':', '_')}.log")
    try:
        wait_http_ready(f"http://127.0.0.1:{cmd.port}{cmd.ready_path}", proc, ready_timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc
