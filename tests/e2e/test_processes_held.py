"""`kvgate serve --processes 2`: while the supervisor holds down a process that keeps failing (here
child 1, whose metrics port another socket holds, so every start of it is refused, exit 2),
process 0, which the probes ask, answers `/readyz` 200 and counts the held one: the pod stays in
service with the process that serves. It used to answer 503 for the whole hold (up to 10 minutes)."""

from __future__ import annotations

import contextlib
import re
import socket
import sys
from collections.abc import Iterator

import httpx

from tests.e2e.harness import free_port, start
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-processes-held"


@contextlib.contextmanager
def _second_port_taken() -> Iterator[int]:
    """A metrics port base whose base is free and base + 1 held by a listening socket, for as
    long as the block lasts. Both in one half (port // 2) of a port `free_port` handed out, so
    in this run's port shard."""
    for _ in range(32):
        base = free_port() & ~1
        taker = socket.socket()
        try:
            taker.bind(("127.0.0.1", base + 1))
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", base))
        except OSError:
            taker.close()
            continue
        taker.listen()
        try:
            yield base
        finally:
            taker.close()
        return
    raise AssertionError("no free pair of ports")


def _ready(metrics_base: int) -> dict[str, object] | None:
    """Process 0's `/readyz` body once it answers 200."""
    try:
        resp = httpx.get(f"http://127.0.0.1:{metrics_base}/readyz", timeout=5)
    except httpx.TransportError:  # not listening yet
        return None
    body: dict[str, object] = resp.json()
    return body if resp.status_code == 200 else None


def test_process_0_is_ready_while_a_process_that_cannot_start_is_held_down() -> None:
    port = free_port()
    with _second_port_taken() as metrics_base:
        argv = [
            sys.executable, "-m", "gateway.cli", "serve", "--demo", "--demo-key", KEY,
            "--processes", "2", "--port", str(port), "--metrics-port", str(metrics_base),
        ]  # fmt: skip
        proc = start(argv)
        try:

            def held() -> bool:
                assert proc.popen.poll() is None, proc.output()[-3000:]
                return "(index 1) could not start 6 times within a minute" in proc.output()

            wait_until_sync(held, 120, "child 1 is held down", interval_s=0.2)
            # The hold lasts 15 s at least; /readyz stayed 503 through all of it before.
            answer = wait_until_sync(lambda: _ready(metrics_base), 10, "process 0's /readyz answers 200")
            assert answer == {"status": "ready", "held": 1}
            metrics = httpx.get(f"http://127.0.0.1:{metrics_base}/metrics", timeout=5).text
            assert re.search(r"^kvgate_processes_held 1\.0$", metrics, re.MULTILINE)
            body = {"model": "kvgate-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            resp = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {KEY}"},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text  # process 0 serves the port
        finally:
            proc.stop()
