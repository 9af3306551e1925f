"""The gateway's budget for whole worker answers held in memory, on real processes: concurrent
large answers past `limits.max_buffered_answer_bytes` get 503 `gateway_overloaded` while the
others are served, the worker's breaker is not blamed, and every path gives its bytes back."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.harness import Proc, free_port, start_fake_workers, start_gateway, tenant, write_gateway_config
from tests.e2e.test_openai_sdk import worker_log
from tests.support.wait import wait_until, wait_until_sync

MIB = 1024 * 1024
# Each answer is 2 MiB (its content; the JSON around it adds a few hundred bytes): two fit in the
# budget, a third does not.
ANSWER_KIB = 2048
BUDGET_BYTES = 5 * MIB
HEADERS = {"authorization": "Bearer sk-acme"}


@dataclass
class BudgetStack:
    base_url: str
    metrics_url: str
    worker: str
    gateway: Proc

    def metrics(self) -> str:
        return httpx.get(self.metrics_url + "/metrics", timeout=5).text

    def sample(self, line_start: str) -> float:
        match = re.search(rf"^{re.escape(line_start)} (\S+)$", self.metrics(), re.M)
        assert match is not None, f"no {line_start} in /metrics"
        return float(match.group(1))

    def held_bytes(self) -> float:
        return self.sample("kvgate_answer_bytes_held")

    def refusals(self) -> float:
        return self.sample("kvgate_answer_budget_refusals_total")

    def cancelled(self) -> list[str]:
        """The requests (by `user`) whose connection the gateway closed before their end."""
        tags: list[str] = worker_log(self.worker)["cancelled"]
        return tags

    def hold(self) -> None:
        httpx.get(self.worker + "/_hold", timeout=5).raise_for_status()

    def release(self) -> None:
        httpx.get(self.worker + "/_release", timeout=5).raise_for_status()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BudgetStack]:
    port = free_port()
    fake = start_fake_workers({port: "big"})
    gateway = None
    try:
        worker = f"http://127.0.0.1:{port}"
        pools = [
            {
                "name": "big",
                "models": ["m-big"],
                "workers": [worker],
                # One failure would open the breaker: the budget's refusals must not count.
                "breaker": {"failure_threshold": 1, "cooldown_s": 600},
                "health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3},
            }
        ]
        folder = tmp_path_factory.mktemp("gw-budget")
        (folder / "policy.yaml").write_text("policy: round_robin\n")
        config = write_gateway_config(
            folder / "gateway.yaml",
            pools,
            [tenant("acme", "sk-acme")],
            policy_file="policy.yaml",
            limits={"max_buffered_answer_bytes": BUDGET_BYTES},
        )
        gw_port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, gw_port, metrics_port)
        yield BudgetStack(f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{metrics_port}", worker, gateway)
    finally:
        if gateway is not None:
            gateway.stop()
        fake.stop()


def _body(user: str, kib: int = ANSWER_KIB) -> dict[str, Any]:
    return {"model": "m-big", "messages": [{"role": "user", "content": "x"}], "max_tokens": kib, "user": user}


def test_answers_past_the_budget_get_503_and_the_others_are_served(stack: BudgetStack) -> None:
    stack.hold()

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            sent = [
                asyncio.create_task(client.post("/v1/chat/completions", json=_body(f"r{i}"), headers=HEADERS))
                for i in range(3)
            ]
            # Two answers fit whole (but for their held last bytes); the third passed the budget.
            done, _ = await asyncio.wait(sent, return_when=asyncio.FIRST_COMPLETED)
            assert [t.result().status_code for t in done] == [503]
            await wait_until(lambda: stack.held_bytes() >= 2 * ANSWER_KIB * 1024, what="two answers held")
            # The refused answer's connection was dropped, so its worker stopped sending (seen
            # while the worker still holds every answer's end, before anything can race it).
            await wait_until(lambda: len(stack.cancelled()) == 1, what="the worker hung up on")
            stack.release()
            return await asyncio.gather(*sent)

    try:
        replies = asyncio.run(run())
    finally:
        stack.release()
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [200, 200, 503]
    refused = next(r for r in replies if r.status_code == 503)
    error = refused.json()["error"]
    assert error["code"] == "gateway_overloaded" and error["type"] == "server_error"
    assert "limits.max_buffered_answer_bytes" in error["message"]
    assert refused.headers["retry-after"] == "1"
    for served in (r for r in replies if r.status_code == 200):
        assert len(served.json()["choices"][0]["message"]["content"]) == ANSWER_KIB * 1024
    wait_until_sync(lambda: stack.held_bytes() == 0, what="the budget back to 0")
    assert stack.refusals() == 1
    # The gateway's own limit: the worker (breaker threshold 1) stays routable, the attempt aborted.
    page = stack.metrics()
    assert f'kvgate_worker_healthy{{pool="big",worker="{stack.worker}"}} 1.0' in page
    assert f'kvgate_worker_breaker_state{{pool="big",worker="{stack.worker}"}} 0.0' in page
    aborted = f'kvgate_worker_requests_total{{outcome="aborted",pool="big",worker="{stack.worker}"}} 1.0'
    assert aborted in page
    assert len(stack.cancelled()) == 1  # and no other
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        again = client.post("/v1/chat/completions", json=_body("after"), headers=HEADERS)
    assert again.status_code == 200


def test_a_client_that_leaves_mid_answer_gives_its_bytes_back(stack: BudgetStack) -> None:
    stack.hold()
    try:
        host, port = stack.base_url.removeprefix("http://").split(":")
        payload = orjson.dumps(_body("leaver", kib=1024))
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sk-acme\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        with socket.create_connection((host, int(port))) as client:
            client.sendall(head.encode() + payload)
            wait_until_sync(lambda: stack.held_bytes() >= 1024 * 1024, what="the answer held")
        wait_until_sync(lambda: stack.held_bytes() == 0, what="the budget back to 0")
        wait_until_sync(lambda: "leaver" in stack.cancelled(), what="the worker hung up on")
    finally:
        stack.release()
