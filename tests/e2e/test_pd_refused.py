"""A request the engine refuses is refused before any worker holds its prompt's KV: real emulated
vLLM prefill and decode workers behind a real gateway.

The prefill leg asks for one token, not streamed, so it would pass fields the decode leg (the
client's request) is refused on: `stream_options` without streaming, a `min_tokens` above the
budget, a budget below 1. Had the prefill worker served it, the prompt's KV would stay held there
for the decode leg that never comes (vLLM: up to 480 s), and requests like these would fill it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import (
    Proc,
    free_port,
    start_emulator,
    start_gateway,
    tenant,
    write_gateway_config,
)
from tests.support.metrics import text_total
from tests.support.wait import wait_until_sync

KEY = "sk-e2e-pd-refused"


@dataclass
class Stack:
    base_url: str
    metrics_url: str
    prefill_url: str

    def counter(self, name: str, **labels: str) -> float:
        """A gateway counter summed over the series whose labels include `labels`."""
        return text_total(httpx.get(self.metrics_url, timeout=5).text, name, **labels)

    def prefill_kv_usage(self) -> float:
        text = httpx.get(self.prefill_url + "/metrics", timeout=5).text
        return float(re.findall(r"^vllm:kv_cache_usage_perc(?:{[^}]*})? (\S+)$", text, re.M)[0])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        urls = {}
        for role in ("prefill", "decode"):
            common = ("--host", "127.0.0.1", "--model", "m", "--time-scale", "10", "--role", role)
            urls[role], proc = start_emulator(*common)
            procs.append(proc)
        pools = [
            {
                "name": "p",
                "models": ["m"],
                "prefill_workers": [urls["prefill"]],
                "decode_workers": [urls["decode"]],
                "pd": {"protocol": "vllm", "conditional": False},
                "health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3},
            }
        ]
        config = write_gateway_config(
            Path(tmp_path_factory.mktemp("pd")) / "gateway.yaml", pools, [tenant("t", KEY)]
        )
        port, metrics_port = free_port(), free_port()
        procs.append(start_gateway(config, port, metrics_port))
        s = Stack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", urls["prefill"])
        wait_until_sync(
            lambda: s.counter("kvgate_worker_healthy", pool="p") >= 2, timeout_s=60, what="both workers up"
        )
        yield s
    finally:
        for proc in reversed(procs):
            proc.stop()


def _chat(stack: Stack, i: int, **extra: Any) -> httpx.Response:
    # A long prompt of its own each time: nothing of it is cached, so the request is split.
    content = f"Request number {i}. " + "Tell me about disaggregation. " * 200
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(
        stack.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "Stream options can only be defined"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "less than or equal to max_tokens=5, got 10"),
        ({"min_tokens": -1, "max_tokens": 5}, "min_tokens", "greater than or equal to 0, got -1"),
        ({"min_tokens": 3, "max_completion_tokens": 2}, "min_tokens", "max_tokens=2, got 3"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ],
)
def test_a_request_the_engine_refuses_holds_no_kv(
    stack: Stack, extra: dict[str, Any], param: str, message: str
) -> None:
    decode_before = stack.counter("kvgate_pd_requests_total", pool="p", role="decode")
    for i in range(3):
        reply = _chat(stack, i, **extra)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert message in error["message"] and error["param"] == param
    # Refused by the prefill worker as the whole request: no decode leg, no KV held.
    assert stack.counter("kvgate_pd_requests_total", pool="p", role="decode") == decode_before
    assert stack.prefill_kv_usage() == 0


def test_valid_requests_with_those_fields_are_split(stack: Stack) -> None:
    """`min_tokens` within the budget and `stream_options` on a stream still split: the prefill
    leg drops them and asks for one token."""
    decode_before = stack.counter("kvgate_pd_requests_total", pool="p", role="decode")
    reply = _chat(stack, 100, min_tokens=3, max_tokens=5)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5
    streamed = _chat(stack, 101, stream=True, stream_options={"include_usage": True}, max_tokens=4)
    assert streamed.status_code == 200 and '"completion_tokens":4' in streamed.text.replace(" ", "")
    assert stack.counter("kvgate_pd_requests_total", pool="p", role="decode") == decode_before + 2
