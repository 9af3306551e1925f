"""On real processes: how a streamed retrieve (`GET /v1/responses/{id}?stream=true`) ends when the
gateway cannot finish it. A worker that dies mid-stream and the drain deadline each end the
client's stream with one error event and nothing after it; the worker's request is closed, and the
tenant's slot and the request's metrics are given back."""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start, start_gateway, wait_http
from tests.support.wait import wait_until_sync

KEY = {"authorization": "Bearer sk-acme"}


@dataclass
class Stack:
    base_url: str
    metrics_url: str
    worker_url: str
    gateway: Proc


@contextlib.contextmanager
def running_stack(folder: Path, **config: Any) -> Iterator[Stack]:
    """The responses worker and a gateway whose one tenant may have one request in flight."""
    procs: list[Proc] = []
    try:
        worker_port = free_port()
        worker_url = f"http://127.0.0.1:{worker_port}"
        procs.append(start([sys.executable, "-m", "tests.support.responses_worker", str(worker_port)]))
        wait_http(worker_url + "/health", procs[-1])
        pools = [{"name": "streamer", "models": ["m"], "workers": [worker_url]}]
        tenants = [tenant("acme", "sk-acme", quotas={"max_concurrent": 1})]
        path = write_gateway_config(folder / "gateway.yaml", pools, tenants, **config)
        port, metrics_port = free_port(), free_port()
        procs.append(start_gateway(path, port, metrics_port))
        yield Stack(
            f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", worker_url, procs[-1]
        )
    finally:
        for proc in reversed(procs):
            proc.stop()


def _create(stack: Stack) -> str:
    """A new stored response's id (the gateway's, as the worker names it)."""
    body = {"model": "m", "input": "hi"}
    resp = httpx.post(stack.base_url + "/v1/responses", json=body, headers=KEY, timeout=10)
    assert resp.status_code == 200
    rid: str = resp.json()["id"]
    return rid


def _closed_early(stack: Stack) -> list[str]:
    closed: list[str] = httpx.get(stack.worker_url + "/_log", timeout=5).json()["closed_early"]
    return closed


def _events(raw: bytes) -> list[dict[str, Any]]:
    events = [e for e in raw.split(b"\n\n") if e]
    return [orjson.loads(e.split(b"data: ", 1)[1]) for e in events]


def _retrieves_counted(stack: Stack, status: str) -> float:
    text = httpx.get(stack.metrics_url, timeout=5).text
    samples = re.findall(r"^kvgate_requests_total\{([^}]*)\} (\S+)$", text, re.M)
    return sum(
        float(value)
        for labels, value in samples
        if 'endpoint="responses.retrieve"' in labels and f'status="{status}"' in labels
    )


def _read_until_in_progress(chunks: Iterator[bytes]) -> bytes:
    got = b""
    while b"response.in_progress" not in got:
        got += next(chunks)
    return got


def test_a_worker_dying_mid_stream_ends_the_retrieve_with_one_error_event(tmp_path: Path) -> None:
    with running_stack(tmp_path) as stack:
        rid = _create(stack)
        url = f"{stack.base_url}/v1/responses/{rid}"
        with httpx.stream("GET", url, params={"stream": "true"}, headers=KEY, timeout=20) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_bytes()
            got = _read_until_in_progress(chunks)
            assert httpx.post(f"{stack.worker_url}/_die/{rid}", timeout=5).status_code == 200
            got += b"".join(chunks)  # the stream ends: the client is not left waiting
        events = _events(got)
        # The worker's half event is never relayed; one error event is the last thing sent.
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
        assert events[-1]["code"] == "upstream_stream_error" and events[-1]["sequence_number"] == 2
        # The request is counted once, and the tenant's one slot is free again.
        wait_until_sync(lambda: _retrieves_counted(stack, "502") == 1, what="the retrieve was counted")
        assert httpx.get(url, headers=KEY, timeout=10).json()["id"] == rid
        assert "Traceback" not in stack.gateway.output()


def test_the_drain_deadline_ends_a_streamed_retrieve_with_gateway_shutting_down(tmp_path: Path) -> None:
    with running_stack(tmp_path, drain={"deadline_s": 1.0}) as stack:
        rid = _create(stack)
        url = f"{stack.base_url}/v1/responses/{rid}"
        received: list[bytes] = []
        streaming = threading.Event()

        def consume() -> None:
            with httpx.stream("GET", url, params={"stream": "true"}, headers=KEY, timeout=20) as resp:
                assert resp.status_code == 200
                chunks = resp.iter_bytes()
                received.append(_read_until_in_progress(chunks))
                streaming.set()
                received.extend(chunks)

        reader = threading.Thread(target=consume)
        reader.start()
        assert streaming.wait(10)
        stack.gateway.popen.send_signal(signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive()
        events = _events(b"".join(received))
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
        assert events[-1]["code"] == "gateway_shutting_down"
        # The worker's request was closed, not left holding the background response's stream.
        wait_until_sync(lambda: rid in _closed_early(stack), what="the worker's stream was closed")
        assert stack.gateway.popen.wait(30) == 0
        output = stack.gateway.output()
        assert "Traceback" not in output and "CancelledError" not in output
