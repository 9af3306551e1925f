"""Outcomes recorded as they happened, on real processes: complete streams are successes, a read
timeout before the first byte goes to another worker, and a worker that answers garbage counts
against it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.harness import Proc, free_port, start_fake_workers, start_gateway, tenant, write_gateway_config
from tests.e2e.test_openai_sdk import worker_log
from tests.support.wait import wait_until_sync

WORKERS = {
    "tail": "tail",
    "hang": "hang",
    "ok_a": "ok",
    "garbage": "garbage",
    "garbage_b": "garbage",
    "ok_b": "ok",
}


@dataclass
class OutcomeStack:
    base_url: str
    metrics_url: str
    workers: dict[str, str]
    gateway: Proc

    def access_lines(self, model: str) -> list[dict[str, Any]]:
        lines = []
        for line in self.gateway.output().splitlines():
            if line.startswith("{") and f'"model":"{model}"' in line and '"status"' in line:
                lines.append(json.loads(line))
        return lines

    def wait_access_lines(self, model: str, count: int) -> list[dict[str, Any]]:
        def logged() -> list[dict[str, Any]] | None:
            lines = self.access_lines(model)
            return lines if len(lines) >= count else None

        return wait_until_sync(logged, what=f"{count} access lines for {model}") or []

    def metrics(self) -> str:
        return httpx.get(self.metrics_url + "/metrics", timeout=5).text

    def routable(self, pool: str, worker: str) -> bool:
        pattern = f'kvgate_worker_healthy{{pool="{pool}",worker="{self.workers[worker]}"}} 1.0'
        return pattern in self.metrics()

    def wait_routable(self, pool: str, worker: str, timeout_s: float = 15.0) -> None:
        wait_until_sync(lambda: self.routable(pool, worker), timeout_s, f"{worker} routable in {pool}")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OutcomeStack]:
    ports = {name: free_port() for name in WORKERS}
    fake = start_fake_workers({ports[name]: mode for name, mode in WORKERS.items()})
    gateway = None
    try:
        w = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        fast = {"health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3}}
        pools = [
            {"name": "tail", "models": ["m-tail"], "workers": [w["tail"]], **fast},
            *(
                {
                    "name": name,
                    "models": [f"m-{name}"],
                    "workers": [w["hang"], w["ok_a"]],
                    "timeouts": {"read_s": 0.5},
                    "breaker": {"failure_threshold": 2, "cooldown_s": 600},
                    **fast,
                }
                for name in ("hung", "hung-stream")
            ),
            {
                "name": "garbage",
                "models": ["m-garbage"],
                "workers": [w["garbage"]],
                "retry_attempts": 0,
                "breaker": {"failure_threshold": 100},
                **fast,
            },
            {
                "name": "garbage2",
                "models": ["m-garbage2"],
                "workers": [w["garbage_b"], w["ok_b"]],
                "breaker": {"failure_threshold": 2, "cooldown_s": 600},
                **fast,
            },
        ]
        folder = tmp_path_factory.mktemp("gw-outcomes")
        (folder / "policy.yaml").write_text("policy: round_robin\n")
        config = write_gateway_config(
            folder / "gateway.yaml", pools, [tenant("acme", "sk-acme")], policy_file="policy.yaml"
        )
        port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, port, metrics_port)
        yield OutcomeStack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}", w, gateway)
    finally:
        if gateway is not None:
            gateway.stop()
        fake.stop()


HEADERS = {"authorization": "Bearer sk-acme"}


def _body(model: str, stream: bool, user: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": stream}
    if user:
        body["user"] = user
    return body


def test_streams_read_to_done_are_successes_and_reuse_the_worker_connection(outcomes: OutcomeStack) -> None:
    # Each stream lasts ~0.4 s, so the gateway's disconnect watcher is running when the worker's
    # [DONE] arrives; the worker ends its body 30 ms after that.
    streams, concurrency = 48, 16

    async def run() -> list[bytes]:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=outcomes.base_url, timeout=10, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency)

            async def one() -> bytes:
                async with gate:
                    resp = await client.post(
                        "/v1/chat/completions", json=_body("m-tail", True), headers=HEADERS
                    )
                    assert resp.status_code == 200
                    return resp.content

            return await asyncio.gather(*(one() for _ in range(streams)))

    bodies = asyncio.run(run())
    assert all(body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body for body in bodies)
    lines = outcomes.wait_access_lines("m-tail", streams)
    assert len(lines) == streams
    assert [line for line in lines if line["status"] != 200] == []
    assert 'status="499"' not in outcomes.metrics()
    # Read to its end, each connection went back to the pool (closing them would take one per
    # stream). It comes back 30 ms after its client had [DONE], so the client's next stream may
    # need a second one meanwhile: at most two per concurrent stream.
    assert worker_log(outcomes.workers["tail"])["connections"] <= 2 * concurrency


@pytest.mark.parametrize("stream", [False, True])
def test_a_read_timeout_before_the_first_byte_is_retried_on_another_worker(
    outcomes: OutcomeStack, stream: bool
) -> None:
    # The hung worker passes its health checks; for a stream it even sends its response head.
    pool = "hung-stream" if stream else "hung"
    outcomes.wait_routable(pool, "hang")
    outcomes.wait_routable(pool, "ok_a")
    client = openai.OpenAI(base_url=outcomes.base_url + "/v1", api_key="sk-acme", max_retries=0, timeout=10)
    tags = [f"timeout-{pool}-{i}" for i in range(6)]
    for tag in tags:
        result = client.chat.completions.create(
            model=f"m-{pool}",
            messages=[{"role": "user", "content": "x"}],
            stream=stream,
            user=tag,
            extra_headers={"x-request-id": tag},
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in result if c.choices)  # type: ignore[union-attr]
        else:
            text = result.choices[0].message.content or ""  # type: ignore[union-attr]
        assert "hello from the fake worker" in text
    hang = worker_log(outcomes.workers["hang"])
    sent_to_hang = [r["body"]["user"] for r in hang["requests"] if r["body"].get("user") in tags]
    # Each timeout counts against the hung worker once another worker has served the request: its
    # breaker (threshold 2) keeps it out after two.
    assert len(sent_to_hang) == 2
    assert not outcomes.routable(pool, "hang")
    assert _retries(outcomes.metrics(), pool, "read_timeout") == 2
    # The gateway hung up on the hung worker (so it can stop) and sent the request on.
    wait_until_sync(
        lambda: set(sent_to_hang) <= set(worker_log(outcomes.workers["hang"])["cancelled"]),
        what="the gateway closed the timed-out requests",
    )
    lines = {line["client_request_id"]: line for line in outcomes.wait_access_lines(f"m-{pool}", 6)}
    assert all(lines[tag]["status"] == 200 for tag in tags)
    assert all(
        lines[tag]["retries"] == 1 and lines[tag]["worker"] == outcomes.workers["ok_a"]
        for tag in sent_to_hang
    )


def _retries(metrics: str, pool: str, reason: str) -> float:
    pattern = re.compile(rf'kvgate_upstream_retries_total{{pool="{pool}",reason="{reason}"}} ([0-9.]+)')
    found = pattern.search(metrics)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_answering_garbage_is_a_clear_502(outcomes: OutcomeStack, stream: bool) -> None:
    outcomes.wait_routable("garbage", "garbage")
    before = len(outcomes.access_lines("m-garbage"))  # the other case's, if it ran on this stack
    resp = httpx.post(
        outcomes.base_url + "/v1/chat/completions",
        json=_body("m-garbage", stream),
        headers=HEADERS,
        timeout=10,
    )
    assert resp.status_code == 502 and resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "bad_gateway"
    assert "malformed" in error["message"]
    (line,) = outcomes.wait_access_lines("m-garbage", before + 1)[-1:]
    assert line["status"] == 502 and line["stream"] is stream


def test_a_worker_answering_garbage_counts_against_it_and_stops_drawing_traffic(
    outcomes: OutcomeStack,
) -> None:
    outcomes.wait_routable("garbage2", "garbage_b")
    outcomes.wait_routable("garbage2", "ok_b")
    client = openai.OpenAI(base_url=outcomes.base_url + "/v1", api_key="sk-acme", max_retries=0, timeout=10)
    for i in range(12):
        stream = i % 2 == 1
        result = client.chat.completions.create(
            model="m-garbage2", messages=[{"role": "user", "content": "x"}], stream=stream
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in result if c.choices)  # type: ignore[union-attr]
        else:
            text = result.choices[0].message.content or ""  # type: ignore[union-attr]
        assert "hello from the fake worker" in text  # retried on the good worker
    # Two malformed answers open its breaker (threshold 2): it draws nothing after that.
    assert len(worker_log(outcomes.workers["garbage_b"])["requests"]) == 2
    assert not outcomes.routable("garbage2", "garbage_b")
    assert _retries(outcomes.metrics(), "garbage2", "malformed_answer") == 2
