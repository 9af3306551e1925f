"""On real processes: stored responses retrieved and cancelled through the gateway when the workers
want an API key, a retrieve with `stream=true` relayed event by event, and vLLM's binary
embeddings (`encoding_format` "bytes") passed through without counting against the worker."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest

from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start, start_emulator, start_gateway, wait_http
from tests.support.wait import wait_until_sync

WORKER_KEY = "sk-worker-3f9a"
KEY = {"authorization": "Bearer sk-acme"}


@dataclass
class Stack:
    base_url: str
    metrics_url: str
    emulator_url: str
    streamer_url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder: Path = tmp_path_factory.mktemp("stored-responses")
    procs: list[Proc] = []
    try:
        emulator_url, emulator = start_emulator("--model", "m-emu", "--api-key", WORKER_KEY)
        procs.append(emulator)
        streamer_port = free_port()
        streamer_url = f"http://127.0.0.1:{streamer_port}"
        procs.append(start([sys.executable, "-m", "tests.support.responses_worker", str(streamer_port)]))
        wait_http(streamer_url + "/health", procs[-1])
        (folder / "worker-key").write_text(WORKER_KEY + "\n")
        fast = {"health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3}}
        pools = [
            {
                "name": "emu",
                "models": ["m-emu"],
                "workers": [emulator_url],
                "worker_api_key_file": "worker-key",
                "breaker": {"failure_threshold": 3, "cooldown_s": 60},
                **fast,
            },
            {
                "name": "streamer",
                "models": ["m"],
                "workers": [streamer_url],
                "forward_headers": ["X-Trace-Tag"],
                **fast,
            },
        ]
        config = write_gateway_config(folder / "gateway.yaml", pools, [tenant("acme", "sk-acme")])
        port, metrics_port = free_port(), free_port()
        procs.append(start_gateway(config, port, metrics_port))
        yield Stack(
            f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", emulator_url, streamer_url
        )
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_stored_response_is_retrieved_and_cancelled_on_a_keyed_worker(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-acme", max_retries=0, timeout=20)
    created = client.responses.create(model="m-emu", input="hello", max_output_tokens=3, store=True)
    assert client.responses.retrieve(created.id).id == created.id
    # The emulator, as vLLM, cancels only background responses: its 400, not a 401 for a missing key.
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(created.id)
    assert "Cannot cancel a synchronous response" in refused.value.message


def _log(stack: Stack) -> dict[str, Any]:
    log: dict[str, Any] = httpx.get(stack.streamer_url + "/_log", timeout=5).json()
    return log


def _create(stack: Stack) -> str:
    """A new stored response's id (the gateway's, as the worker names it)."""
    body = {"model": "m", "input": "hi"}
    resp = httpx.post(stack.base_url + "/v1/responses", json=body, headers=KEY, timeout=10)
    assert resp.status_code == 200
    rid: str = resp.json()["id"]
    return rid


def test_a_streamed_retrieve_reaches_the_client_event_by_event(stack: Stack) -> None:
    rid = _create(stack)
    url = f"{stack.base_url}/v1/responses/{rid}"
    headers = {**KEY, "x-trace-tag": "t-1"}
    params = {"stream": "true", "starting_after": "0"}
    with httpx.stream("GET", url, params=params, headers=headers, timeout=20) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = resp.iter_bytes()
        got = b""
        while b"response.in_progress" not in got:
            got += next(chunks)  # arrives while the worker still holds the stream
        assert rid not in _log(stack)["closed_early"]
        assert httpx.post(f"{stack.streamer_url}/_release/{rid}", timeout=5).status_code == 200
        got += b"".join(chunks)
    events = [e for e in got.split(b"\n\n") if e]
    kinds = [orjson.loads(e.split(b"data: ", 1)[1])["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.completed"]
    (seen,) = [r for r in _log(stack)["retrieves"] if r["id"] == rid]
    assert seen["query"] == "stream=true&starting_after=0"
    assert seen["headers"]["x-trace-tag"] == "t-1"


def test_a_client_leaving_a_streamed_retrieve_closes_the_workers_stream(stack: Stack) -> None:
    rid = _create(stack)
    url = f"{stack.base_url}/v1/responses/{rid}"
    with httpx.stream("GET", url, params={"stream": "true"}, headers=KEY, timeout=20) as resp:
        first = next(resp.iter_bytes())
        assert b"response.created" in first
    wait_until_sync(lambda: rid in _log(stack)["closed_early"], what="the worker's stream was closed")
    # The tenant's concurrency slot came back: another retrieve is served.
    assert httpx.get(url, headers=KEY, timeout=10).json()["id"] == rid


def _failed_attempts(stack: Stack) -> float:
    text = httpx.get(stack.metrics_url, timeout=5).text
    pattern = r'kvgate_worker_requests_total\{[^}]*outcome="worker_failed"[^}]*pool="emu"[^}]*\} (\S+)'
    alt = r'kvgate_worker_requests_total\{[^}]*pool="emu"[^}]*outcome="worker_failed"[^}]*\} (\S+)'
    return sum(float(v) for p in (pattern, alt) for v in re.findall(p, text))


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_binary_embeddings_are_passed_through_and_never_trip_the_breaker(stack: Stack, path: str) -> None:
    body = {"model": "m-emu", "input": ["hello world", "abc"], "dimensions": 8}
    for _ in range(4):  # more than the breaker's threshold
        resp = httpx.post(
            stack.base_url + path, json={**body, "encoding_format": "bytes"}, headers=KEY, timeout=10
        )
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/octet-stream"
        meta = orjson.loads(resp.headers["metadata"])
        assert [(d["start"], d["end"], d["shape"]) for d in meta["data"]] == [(0, 32, [8]), (32, 64, [8])]
        assert meta["usage"]["prompt_tokens"] > 0 and len(resp.content) == 64
    only = httpx.post(
        stack.base_url + path, json={**body, "encoding_format": "bytes_only"}, headers=KEY, timeout=10
    )
    assert only.status_code == 200 and "metadata" not in only.headers and only.content == resp.content
    floats = httpx.post(stack.base_url + path, json=body, headers=KEY, timeout=10)
    assert floats.status_code == 200
    vectors = np.frombuffer(resp.content, "<f4")
    field = "embedding" if path == "/v1/embeddings" else "data"
    assert np.allclose(vectors[:8], floats.json()["data"][0][field])
    assert _failed_attempts(stack) == 0
