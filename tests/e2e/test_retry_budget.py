"""No retry amplification: one OpenAI-SDK call (its default two retries left on) against workers
that all answer 500 makes at most 1 + `retry_attempts` worker POSTs, counted by the workers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from tests.e2e.harness import Proc, free_port, start_fake_workers, start_gateway, tenant, write_gateway_config
from tests.e2e.test_openai_sdk import worker_log


@dataclass
class FailingStack:
    base_url: str
    workers: list[str]


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailingStack]:
    ports = [free_port() for _ in range(3)]
    fake = start_fake_workers({port: "error500" for port in ports})
    gateway: Proc | None = None
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        common = {
            "health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3},
            "breaker": {"failure_threshold": 1000},  # every attempt must reach a worker
        }
        pools = [
            {"name": "three", "models": ["m-three"], "workers": urls, "retry_attempts": 2, **common},
            {"name": "two", "models": ["m-two"], "workers": urls, "retry_attempts": 1, **common},
            {"name": "single", "models": ["m-single"], "workers": urls[:1], "retry_attempts": 1, **common},
            {"name": "none", "models": ["m-none"], "workers": urls[:1], "retry_attempts": 0, **common},
        ]
        folder = tmp_path_factory.mktemp("gw-retry-budget")
        (folder / "policy.yaml").write_text("policy: round_robin\n")
        config = write_gateway_config(
            folder / "gateway.yaml", pools, [tenant("acme", "sk-acme")], policy_file="policy.yaml"
        )
        port = free_port()
        gateway = start_gateway(config, port)
        yield FailingStack(f"http://127.0.0.1:{port}", urls)
    finally:
        if gateway is not None:
            gateway.stop()
        fake.stop()


def _posts(stack: FailingStack, tag: str) -> int:
    return sum(
        1 for url in stack.workers for r in worker_log(url)["requests"] if r["body"].get("user") == tag
    )


@pytest.mark.parametrize(("model", "budget"), [("m-three", 3), ("m-two", 2), ("m-single", 2), ("m-none", 1)])
@pytest.mark.parametrize("stream", [False, True])
def test_one_sdk_call_makes_at_most_one_plus_retry_attempts_worker_posts(
    failing: FailingStack, model: str, budget: int, stream: bool
) -> None:
    client = openai.OpenAI(base_url=failing.base_url + "/v1", api_key="sk-acme", timeout=10)
    assert client.max_retries == 2  # the SDK's default: it would retry twice on its own
    tag = uuid.uuid4().hex
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], user=tag, stream=stream
        )
    assert info.value.status_code == 502
    assert info.value.response.headers["x-should-retry"] == "false"
    # Every worker answers 500, so the call spends its whole budget, and never more.
    assert _posts(failing, tag) == budget
