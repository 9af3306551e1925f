"""Engine-internal fields nested where an engine reads them: vLLM starts a request's
`SamplingParams.extra_args` from `vllm_xargs` (chat, completions, Responses, the chat batch) and
takes `sampling_params.extra_args` as sent on `/inference/v1/generate`; its engine reads
`kv_transfer_params` from `extra_args`. Refused with the top-level field's 400, naming the path;
any other `vllm_xargs` key reaches the worker, and the gateway's own P/D legs still carry theirs.

The gateway runs in-process in front of scripted workers (`routes_worker`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.gateway.routes_rig import KEY, Rig, routes_rig
from tests.gateway.test_pd_routes import pd_rig

_PARAMS = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_block_ids": [1]}
_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# Each route, a body the worker takes, and where the nested field goes in it.
_NESTED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {**_CHAT, "vllm_xargs": {"kv_transfer_params": _PARAMS}}, "vllm_xargs"),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "vllm_xargs": {"kv_transfer_params": ["do_remote_decode"]}},
        "vllm_xargs",
    ),
    ("/v1/responses", {"input": "hi", "vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs"),
    (
        "/v1/chat/completions/batch",
        {"messages": [[{"role": "user", "content": "hi"}]], "vllm_xargs": {"kv_transfer_params": 1}},
        "vllm_xargs",
    ),
    (
        "/inference/v1/generate",
        {
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 2, "extra_args": {"kv_transfer_params": _PARAMS}},
        },
        "sampling_params.extra_args",
    ),
    (
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{}, {"extra_args": {"kv_transfer_params": _PARAMS}}]},
        "sampling_params[1].extra_args",
    ),
]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig(limits={"max_body_bytes": 65536}) as rig:
        yield rig


@pytest.mark.parametrize(("path", "body", "where"), _NESTED, ids=[path for path, _, _ in _NESTED])
async def test_kv_transfer_params_nested_where_the_engine_reads_it_is_refused(
    rig: Rig, path: str, body: dict[str, Any], where: str
) -> None:
    resp = await rig.client.post(path, json={"model": "m", **body}, headers=KEY)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    param = f"{where}.kv_transfer_params"
    # The same refusal as the field at the top level.
    top = await rig.client.post(path, json={"model": "m", **body, "kv_transfer_params": {}}, headers=KEY)
    assert top.status_code == 400
    assert error["param"] == param and param in error["message"] and "engine-internal" in error["message"]
    assert (error["type"], error["code"]) == (top.json()["error"]["type"], top.json()["error"]["code"])
    assert not any(w.received for w in rig.workers)


async def test_other_vllm_xargs_and_extra_args_reach_the_worker(rig: Rig) -> None:
    xargs = {"target_token": 7, "tags": ["a", 1]}
    resp = await rig.client.post(
        "/v1/chat/completions", json={"model": "m", **_CHAT, "vllm_xargs": xargs}, headers=KEY
    )
    assert resp.status_code == 200 and rig.last().json()["vllm_xargs"] == xargs
    sampling = {"max_tokens": 2, "extra_args": {"target_token": 7}}
    body = {"model": "m", "token_ids": [1, 2, 3], "sampling_params": sampling}
    assert (await rig.client.post("/inference/v1/generate", json=body, headers=KEY)).status_code == 200
    assert rig.last().json()["sampling_params"] == sampling


async def test_the_gateways_own_pd_legs_still_carry_kv_transfer_params() -> None:
    body = {**_CHAT, "vllm_xargs": {"target_token": 7}}
    async with pd_rig("vllm") as pd:
        resp = await pd.client.post("/v1/chat/completions", json={"model": "m", **body}, headers=KEY)
        assert resp.status_code == 200
        (p, prefill), (d, decode) = pd.arrivals("/v1/chat/completions")
        assert (p, d) == ("prefill", "decode")
        assert prefill["kv_transfer_params"]["do_remote_decode"] is True
        assert prefill["vllm_xargs"] == decode["vllm_xargs"] == {"target_token": 7}


@pytest.mark.parametrize(
    "prompt", [{"text": "hi"}, {"input_ids": [1, 2, 3]}, {}], ids=["with_text", "with_ids", "alone"]
)
async def test_sglang_input_embeds_are_refused_as_prompt_embeds_are(rig: Rig, prompt: dict[str, Any]) -> None:
    """SGLang's `/generate` runs `input_embeds` in place of the text or token ids: the prefix keys
    of the text would not describe what the engine computes."""
    body = {"model": "m", **prompt, "input_embeds": [[0.1, 0.2], [0.3, 0.4]]}
    resp = await rig.client.post("/generate", json=body, headers=KEY)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "input_embeds" and "engine-internal" in error["message"]
    assert not any(w.received for w in rig.workers)
