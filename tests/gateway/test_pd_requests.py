"""A request an SGLang prefill/decode pool could never run is refused with 400 up front: several
sequences run whole, on a mixed server only, and a pool listing none could not run them."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import PoolConfig
from gateway.pd_requests import unrunnable
from gateway.registry import Pool
from tests.gateway.test_pd_dialects import KEY, pd_rig

PAIRS: dict[str, Any] = {
    "prefill_workers": ["http://10.0.0.1:8000"],
    "decode_workers": ["http://10.0.0.2:8000"],
}


def _pool(protocol: str, **workers: Any) -> Pool:
    return Pool(
        PoolConfig(
            name="p", models=["m"], **(workers or PAIRS), pd={"protocol": protocol, "bootstrap_port": 8998}
        )
    )


@pytest.mark.parametrize(
    "body",
    [{"n": 2}, {"best_of": 3}, {"prompt": ["a", "b"]}, {"text": ["a", "b"]}, {"sampling_params": {"n": 2}}],
)
def test_several_sequences_in_an_sglang_pool_without_a_mixed_server_are_refused(body: dict[str, Any]) -> None:
    refusal = unrunnable(_pool("sglang"), True, body)
    assert refusal is not None and refusal.status == 400 and refusal.param == "n"


def test_one_sequence_a_mixed_server_a_vllm_pool_or_a_route_that_does_not_generate_runs() -> None:
    assert unrunnable(_pool("sglang"), True, {"n": 1, "prompt": "a"}) is None
    assert unrunnable(_pool("sglang", **PAIRS, workers=["http://10.0.0.3:8000"]), True, {"n": 2}) is None
    assert unrunnable(_pool("vllm"), True, {"n": 2}) is None  # a vLLM decode server runs it alone
    assert unrunnable(_pool("sglang"), False, {"prompt": ["a", "b"]}) is None  # embeddings, ...
    # A pool that discovers its workers may have a mixed one later (a rollout): 503 meanwhile.
    found = _pool("sglang", workers_file={"path": "/nonexistent/workers.yaml"})
    assert found.workers == {} and unrunnable(found, True, {"n": 2}) is None


async def test_the_gateway_answers_400_and_no_worker_is_asked() -> None:
    async with pd_rig("sglang") as rig:
        body = {"model": "m", "input": "hi", "n": 2}
        resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "n"
        assert rig.prefill.responses_bodies == [] and rig.decode.responses_bodies == []
