"""On real processes: a client that sends one `request_id` with two conversations, through one
gateway in front of two emulated vLLM workers that store responses (round_robin: one on each),
gets two responses of their own ids. A second gateway of the deployment, which routed neither,
retrieves each as it was created and continues each conversation, not the other."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start_emulator, start_gateway

MODEL = "m-emu"
KEY = {"authorization": "Bearer sk-acme"}


@dataclass
class Deployment:
    first: str  # the gateway that creates the responses
    second: str  # another gateway of the deployment, started later


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    procs: list[Proc] = []
    try:
        urls = []
        for _ in range(2):
            url, proc = start_emulator("--model", MODEL)
            urls.append(url)
            procs.append(proc)
        (tmp_path / "policy.yaml").write_text("policy: round_robin\n")
        pools = [{"name": "emu", "models": [MODEL], "workers": urls}]
        config = write_gateway_config(
            tmp_path / "gateway.yaml", pools, [tenant("acme", "sk-acme")], policy_file="policy.yaml"
        )
        bases = []
        for _ in range(2):
            port = free_port()
            procs.append(start_gateway(config, port))
            bases.append(f"http://127.0.0.1:{port}")
        yield Deployment(*bases)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _post(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4, **body}, headers=KEY)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def test_one_request_id_twice_names_two_conversations_every_gateway_tells_apart(
    deployment: Deployment,
) -> None:
    with (
        httpx.Client(base_url=deployment.first, timeout=30) as first,
        httpx.Client(base_url=deployment.second, timeout=30) as second,
    ):
        long = _post(first, {"input": "alpha " * 300, "request_id": "conv-42"})
        short = _post(first, {"input": "beta", "request_id": "conv-42"})
        assert long["id"] != short["id"]
        assert long["id"].startswith("conv-42_") and short["id"].startswith("conv-42_")
        long_tokens, short_tokens = long["usage"]["input_tokens"], short["usage"]["input_tokens"]
        assert long_tokens > 300 > short_tokens
        for created in (long, short):
            # The other gateway finds each response on its worker, as it was created.
            got = second.get(f"/v1/responses/{created['id']}", headers=KEY)
            assert got.status_code == 200, got.text
            assert got.json()["output"][0]["id"] == created["output"][0]["id"]
        # Each follow-up continues its own conversation: its prompt holds that history only.
        after_short = _post(second, {"input": "gamma", "previous_response_id": short["id"]})
        after_long = _post(second, {"input": "gamma", "previous_response_id": long["id"]})
        assert short_tokens < after_short["usage"]["input_tokens"] < long_tokens
        assert after_long["usage"]["input_tokens"] > long_tokens
