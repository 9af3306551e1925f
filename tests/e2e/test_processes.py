"""`kvgate serve --demo --processes 2`: two gateway processes on one port (SO_REUSEPORT) share what
they route through the nats-server the CLI starts; SIGTERM stops every process it started."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from tests.e2e.harness import Proc, alive, free_port, metrics_urls, processes_demo, start, wait_http
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-processes"


def _descendants(pid: int) -> set[int]:
    """Every live process whose parent chain reaches `pid`."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[str, Proc]]:
    with processes_demo(KEY) as running:
        yield running


def _ask(base: str) -> int:
    body = {
        "model": "kvgate-demo",
        "messages": [
            {"role": "system", "content": "You keep the harbour light and answer in one line. " * 40},
            {"role": "user", "content": "Is the light on?"},
        ],
        "max_tokens": 4,
    }
    # A fresh client is a fresh connection: the kernel picks the process.
    with httpx.Client(timeout=30) as client:
        resp = client.post(
            base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
    assert resp.status_code == 200, resp.text
    cached: int = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _metrics_urls(proc: Proc) -> list[str]:
    """Each process's own /metrics (a free port each), as it prints it at startup."""
    return sorted(set(metrics_urls(proc)))


def _probe(metrics_url: str) -> tuple[int, int]:
    """(chat requests answered with 200, peers' items applied) of one process."""
    with httpx.Client(timeout=5) as client:
        text = client.get(metrics_url).text
    served = re.search(r'kvgate_requests_total\{endpoint="chat",[^}]*status="200"[^}]*\} (\S+)', text)
    applied = re.search(r'kvgate_sync_events_total\{event="applied_items"\} (\S+)', text)
    return (int(float(served.group(1))) if served else 0, int(float(applied.group(1))) if applied else 0)


def _probes(proc: Proc) -> list[tuple[int, int]]:
    return [_probe(url) for url in _metrics_urls(proc)]


def test_the_same_prompt_over_fresh_connections_is_cached_after_the_first(demo: tuple[str, Proc]) -> None:
    base, proc = demo
    assert "2 gateway processes on 127.0.0.1" in proc.output()
    cached = [_ask(base)]
    # The process that did not serve it has applied what the other published (the sync's own
    # delay: a few ms, more on a loaded machine); then the prefix is known to both.
    wait_until_sync(
        lambda: any(served == 0 and applied >= 1 for served, applied in _probes(proc)),
        20,
        "the process that did not serve it applied what the other published",
    )
    cached += [_ask(base) for _ in range(9)]
    assert cached[0] < 64 and all(c >= 1024 for c in cached[1:]), cached
    # Both processes served some of them. (The chance that the kernel sent all 20 request
    # connections to one process is about 2e-6.)
    cached += [_ask(base) for _ in range(10)]
    assert all(c >= 1024 for c in cached[1:])
    served = [k for k, _ in _probes(proc)]
    assert sum(served) == 20 and all(k > 0 for k in served), served


def test_the_local_broker_admits_only_the_runs_token(demo: tuple[str, Proc]) -> None:
    _, proc = demo
    match = re.search(r"sharing through (nats://127\.0\.0\.1:\d+) \(a local nats-server\)", proc.output())
    assert match, proc.output()

    async def refused(token: str | None) -> str:
        with pytest.raises(nats.errors.Error) as info:
            await nats.connect(
                match.group(1),
                token=token,
                allow_reconnect=False,
                connect_timeout=5,
                max_reconnect_attempts=0,
            )
        return str(info.value)

    for token in (None, "0" * 64):
        assert "Authorization Violation" in asyncio.run(refused(token))
    # The run's token (64 hex digits) is on no command line: any local user can read those.
    argvs = []
    for pid in _descendants(proc.popen.pid):
        with contextlib.suppress(OSError):
            argvs.append((Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0"))
    assert any(b"--sync-token-env" in argv for argv in argvs)
    assert not any(re.fullmatch(rb"[0-9a-f]{64}", arg) for argv in argvs for arg in argv)


def test_sigterm_stops_gateways_broker_and_workers() -> None:
    port = free_port()
    proc = start(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--demo",
            "--processes",
            "2",
            "--port",
            str(port),
            "--metrics-port",
            "0",
        ]
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=60)
        deadline = time.monotonic() + 30
        while len(_descendants(proc.popen.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = _descendants(proc.popen.pid)
        assert len(started) >= 5  # 2 workers, 1 nats-server, 2 gateway processes
    finally:
        assert proc.stop() == 0
    assert not any(alive(p) for p in started)
