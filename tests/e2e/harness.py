"""What the e2e modules import: the shared process and gateway-config machinery of
`tests.support`, and the scripted fake workers (`tests.e2e.fake_worker`) started as one process."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai

from tests.support.gateway_config import SECRET, tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start, start_emulator, start_gateway, wait_http
from tests.support.wait import wait_until_sync

__all__ = [
    "SECRET",
    "Proc",
    "assert_sigterm_stops_the_workers",
    "free_port",
    "gateway_over_one_emulator",
    "metrics_urls",
    "processes_demo",
    "serving_processes",
    "start",
    "start_emulator",
    "start_fake_workers",
    "start_gateway",
    "tenant",
    "wait_http",
    "write_gateway_config",
]


@contextlib.contextmanager
def gateway_over_one_emulator(folder: Path, model: str, key: str) -> Iterator[str]:
    """A gateway process in front of one emulated worker serving `model` (at 20× speed), its
    tenant `t` holding `key`; yields the gateway's base URL and stops both on the way out."""
    emulator, worker = start_emulator("--model", model, "--time-scale", "20")
    procs: list[Proc] = [worker]
    try:
        path = write_gateway_config(
            folder / "gw.yaml", [{"name": "p", "models": [model], "workers": [emulator]}], [tenant("t", key)]
        )
        port = free_port()
        procs.append(start_gateway(path, port))
        yield f"http://127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            proc.stop()


def metrics_urls(proc: Proc) -> list[str]:
    """Every /metrics URL the processes of `kvgate serve --processes` printed as they started, in
    order (one line per start, so a restarted process adds one)."""
    return re.findall(r"metrics (http://127\.0\.0\.1:\d+/metrics)", proc.output())


@contextlib.contextmanager
def serving_processes(
    *serve_args: str, processes: int = 2, env: dict[str, str] | None = None
) -> Iterator[tuple[str, Proc]]:
    """`kvgate serve --processes N` (plus `serve_args`) on a free port, each process on a metrics
    port of its own: (base URL, supervisor) once every process listens; stopped by PID after (a
    test may stop it first, to check how it exits)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "gateway.cli", "serve", *serve_args, "--processes", str(processes),
        "--port", str(port), "--metrics-port", "0",
    ]  # fmt: skip
    proc = start(argv, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=60)
        wait_until_sync(lambda: len(set(metrics_urls(proc))) == processes, 30, "every process listens")
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


def processes_demo(
    key: str, *extra: str, processes: int = 2
) -> contextlib.AbstractContextManager[tuple[str, Proc]]:
    """`serving_processes` of `kvgate serve --demo --demo-key KEY` (plus `extra`)."""
    return serving_processes("--demo", "--demo-key", key, *extra, processes=processes)


def start_fake_workers(modes: dict[int, str]) -> Proc:
    """One fake-worker process listening on every port of `modes`, each with its behaviour."""
    argv = [sys.executable, "-m", "tests.e2e.fake_worker"]
    for port, mode in modes.items():
        argv += ["--listen", f"{port}:{mode}"]
    proc = start(argv)
    try:
        for port in modes:
            wait_http(f"http://127.0.0.1:{port}/health", proc)
    except BaseException:
        proc.stop()
        raise
    return proc


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def gateway_processes(supervisor: int) -> set[int]:
    """The live gateway processes of a `kvgate serve --processes` supervisor (not its
    nats-server or emulated workers)."""
    return {pid for pid in _children(supervisor) if b"--reuse-port" in _argv(pid) and alive(pid)}


def broker_processes(supervisor: int) -> set[int]:
    """The live nats-servers a supervisor started."""
    return {pid for pid in _children(supervisor) if _argv(pid)[0].endswith(b"nats-server") and alive(pid)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_sigterm_stops_the_workers(serve_args: Sequence[str], workers: int, ready_timeout_s: float) -> None:
    """Start `kvgate serve <serve_args>` on a free port (its /metrics on another) and wait until
    it is ready with `workers` live children; on SIGTERM it exits 0 and takes every child with it."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        *serve_args,
        "--port",
        str(port),
        "--metrics-port",
        "0",
    ]
    proc = start(argv)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=ready_timeout_s)
        children = _children(proc.popen.pid)
        assert len(children) == workers and all(alive(c) for c in children)
    finally:
        assert proc.stop() == 0
    assert not any(alive(c) for c in children)


def chat_burst(base_url: str, key: str, n: int) -> list[int]:
    """`n` one-token chats, one after another, each on a fresh connection (so the kernel picks the
    process of a `--processes` group): 200 or 429 each."""
    statuses: list[int] = []
    for _ in range(n):
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
            try:
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
                statuses.append(200)
            except openai.RateLimitError:
                statuses.append(429)
    return statuses
