"""A request that a prefill/decode pool runs on one worker alone gets what a pool without roles
gives it: Responses follow-ups reach the worker that stored their state, the client's own
retries count against the pool's retry budget, the last error says whether to retry, and the
Anthropic route answers errors in its own shape. Real emulated workers and fake workers that
answer 500, behind a real gateway whose pools are `pd.mode: holder_prefill` (all mixed)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import (
    Proc,
    free_port,
    start_emulator,
    start_fake_workers,
    start_gateway,
    tenant,
    write_gateway_config,
)
from tests.e2e.test_pd_failures import KEY, PdStack, _wait_routable

HOLDER = {"protocol": "vllm", "mode": "holder_prefill"}


@dataclass
class Stack:
    pd: PdStack
    fake_urls: list[str]

    def post(self, path: str, body: dict[str, object], **headers: str) -> httpx.Response:
        auth = {"authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
        return httpx.post(self.pd.base_url + path, json=body, headers={**auth, **headers}, timeout=30)

    def worker_posts(self) -> int:
        return sum(len(httpx.get(u + "/_log", timeout=5).json()["requests"]) for u in self.fake_urls)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    fake_ports = [free_port(), free_port()]
    procs: dict[str, Proc] = {"fake": start_fake_workers(dict.fromkeys(fake_ports, "error500"))}
    fake_urls = [f"http://127.0.0.1:{p}" for p in fake_ports]
    urls: dict[str, str] = {}
    gateway: Proc | None = None
    try:
        for name in ("w0", "w1"):
            urls[name], procs[name] = start_emulator("--host", "127.0.0.1", "--model", "m-ok")
        folder = Path(tmp_path_factory.mktemp("alone"))
        # Round robin: a follow-up's pick is the other worker every other time.
        (folder / "policy.yaml").write_text("policy: round_robin\n")
        health = {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3}
        pools = [
            {
                "name": "ok",
                "models": ["m-ok"],
                "workers": list(urls.values()),
                "pd": HOLDER,
                "health": health,
            },
            # Fake workers answer every generation with a 500 and their health checks with 200.
            {"name": "bad", "models": ["m-bad"], "workers": fake_urls, "pd": HOLDER, "retry_attempts": 1},
        ]
        config = write_gateway_config(
            folder / "gateway.yaml", pools, [tenant("t", KEY)], policy_file="policy.yaml"
        )
        port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, port, metrics_port)
        pd = PdStack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", procs, urls)
        _wait_routable(pd, {"ok": 2, "bad": 2})
        yield Stack(pd, fake_urls)
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs.values():
            proc.stop()


def test_responses_follow_ups_reach_the_worker_that_stored_them(stack: Stack) -> None:
    first = stack.post("/v1/responses", {"model": "m-ok", "input": "hi", "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    previous, statuses = first.json()["id"], []
    for i in range(6):
        body = {
            "model": "m-ok",
            "input": f"and {i}?",
            "previous_response_id": previous,
            "max_output_tokens": 4,
        }
        reply = stack.post("/v1/responses", body)
        statuses.append(reply.status_code)
        if reply.status_code == 200:
            previous = reply.json()["id"]
    assert statuses == [200] * 6


def test_the_clients_retries_count_against_the_pools_budget(stack: Stack) -> None:
    chat = {"model": "m-bad", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    before = stack.worker_posts()
    first = stack.post("/v1/chat/completions", chat)
    # retry_attempts 1: two workers tried, and the client is told not to try again.
    assert first.status_code == 502 and first.headers["x-should-retry"] == "false"
    assert stack.worker_posts() == before + 2
    # The SDK's third try (two retries taken): one worker, whatever the pool's budget.
    third = stack.post("/v1/chat/completions", chat, **{"x-stainless-retry-count": "2"})
    assert third.status_code == 502 and third.headers["x-should-retry"] == "false"
    assert stack.worker_posts() == before + 3


def test_anthropic_messages_errors_keep_their_shape(stack: Stack) -> None:
    body = {"model": "m-bad", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = stack.post("/v1/messages", body)
    assert reply.status_code >= 500
    doc = reply.json()
    assert doc["type"] == "error" and isinstance(doc["error"]["type"], str) and doc["error"]["message"]
