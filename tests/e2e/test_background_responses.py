"""On real processes: background Responses (`"background": true`) through the gateway, with the
OpenAI SDK, against an emulated vLLM worker that runs them as vLLM does. The gateway answers the
queued object at once, retrieves the finished one from the worker that runs it, cancels a running
one there (the worker stops computing), replays a background stream from where the client left it,
and keeps each tenant's background responses its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start_emulator, start_gateway
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

MODEL = "m-bg"
LONG = 30000  # output tokens: many seconds of engine time, so the run is surely still going


@dataclass
class Stack:
    base_url: str
    emulator_url: str

    def client(self, key: str = "sk-acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder: Path = tmp_path_factory.mktemp("background-responses")
    procs: list[Proc] = []
    try:
        emulator_url, emulator = start_emulator("--model", MODEL)
        procs.append(emulator)
        pools = [{"name": "emu", "models": [MODEL], "workers": [emulator_url]}]
        tenants = [tenant("acme", "sk-acme"), tenant("globex", "sk-globex")]
        config = write_gateway_config(folder / "gateway.yaml", pools, tenants)
        port, metrics_port = free_port(), free_port()
        procs.append(start_gateway(config, port, metrics_port))
        yield Stack(f"http://127.0.0.1:{port}", emulator_url)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _running(stack: Stack) -> float:
    """The worker's `vllm:num_requests_running`."""
    for line in httpx.get(stack.emulator_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_running missing")


def _events(resp: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


def test_a_background_response_is_queued_then_retrieved_done(stack: Stack) -> None:
    client = stack.client()
    queued = client.responses.create(
        model=MODEL, input="in the background", max_output_tokens=5, background=True
    )
    assert queued.status == "queued" and queued.background is True
    done = wait_until_sync(
        lambda: (got := client.responses.retrieve(queued.id)).status != "queued" and got,
        what="the background run ended",
    )
    assert done.id == queued.id
    assert done.status == "incomplete"  # cut at max_output_tokens, as vLLM says
    assert done.usage is not None and done.usage.output_tokens == 5
    assert done.output_text


def test_another_tenant_cannot_see_or_cancel_a_background_response(stack: Stack) -> None:
    queued = stack.client().responses.create(
        model=MODEL, input="mine alone", max_output_tokens=LONG, background=True
    )
    other = stack.client("sk-globex")
    try:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(queued.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.cancel(queued.id)
        assert stack.client().responses.retrieve(queued.id).status == "queued"  # still running
    finally:
        stack.client().responses.cancel(queued.id)


def test_cancel_through_the_gateway_stops_the_workers_run(stack: Stack) -> None:
    client = stack.client()
    queued = client.responses.create(model=MODEL, input="a long one", max_output_tokens=LONG, background=True)
    wait_until_sync(lambda: _running(stack) >= 1, what="the worker runs it")
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    wait_until_sync(lambda: _running(stack) == 0, what="the worker stopped computing")
    # Cancelled is final: a second cancel is vLLM's 400, relayed.
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(queued.id)


def test_a_background_stream_is_resumed_through_the_gateway(stack: Stack) -> None:
    body = {"model": MODEL, "input": "stream it", "max_output_tokens": 6, "background": True, "stream": True}
    headers = {"authorization": "Bearer sk-acme"}
    url = stack.base_url + "/v1/responses"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=20) as resp:
        assert resp.status_code == 200
        first = _events(resp)
    assert first[-1]["type"] == "response.completed"
    rid = first[0]["response"]["id"]
    cut = 2  # the client saw events 0..2, then lost the connection
    url = f"{stack.base_url}/v1/responses/{rid}?stream=true&starting_after={cut}"
    with httpx.stream("GET", url, headers=headers, timeout=20) as resp:
        assert resp.status_code == 200
        rest = _events(resp)
    assert [e["sequence_number"] for e in rest] == [e["sequence_number"] for e in first[cut + 1 :]]
    assert rest[-1]["type"] == "response.completed"
