"""What a vLLM prefill leg keeps of the client's request: a `min_tokens` the engine refuses stays,
so the prefill worker refuses the request before it holds any KV. With no budget sent the
engine's own default for the route counts (vLLM's completions and native generate: 16)."""

from __future__ import annotations

import orjson

from gateway.admission import admit
from gateway.auth import hash_api_key
from gateway.pd_bodies import _Budget, _refused, vllm_prefill_body
from gateway.request_head import RequestIds
from gateway.routes import ROUTES
from policies import make_policy
from policies.base import RouteDecision, WorkerId
from tests.support.inprocess import gateway_in_process


def test_min_tokens_past_the_routes_default_budget_is_refused_when_no_budget_is_sent() -> None:
    completions = _Budget(("max_tokens",), 16)
    assert _refused({"min_tokens": 20}, completions)
    assert not _refused({"min_tokens": 16}, completions)
    assert not _refused({"min_tokens": 20, "max_tokens": 32}, completions)
    assert _refused({"min_tokens": 20, "max_tokens": 8}, completions)


def test_a_chat_without_a_budget_is_left_to_its_context_window() -> None:
    chat = _Budget(("max_completion_tokens", "max_tokens"))
    assert not _refused({"min_tokens": 500}, chat)  # the window's rest: not judged here
    assert _refused({"min_tokens": 5, "max_completion_tokens": 4}, chat)
    assert _refused({"max_tokens": 0}, chat)


async def test_sampling_params_the_engine_refuses_reach_the_prefill_leg_as_sent() -> None:
    # vLLM's native generate takes an object there; anything else was replaced by a valid one in
    # the prefill leg, which then held the prompt's KV for a decode leg the engine refuses.
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk-t")]}],
        "scrape": {"enabled": False},
    }
    route = ROUTES["/inference/v1/generate"]
    decision = RouteDecision(WorkerId("http://127.0.0.1:9"), 0.0, "test")
    cases: list[tuple[object, object]] = [
        ([1, 2], [1, 2]),
        ({"max_tokens": 8}, {"max_tokens": 1}),
        (None, {"max_tokens": 1}),
    ]
    policy = make_policy("round_robin")
    async with gateway_in_process(config, policy, secret=b"k", workers_up=False) as gw:
        gate = gw.state.gate
        tenant = gate.keyring.tenants["t"]
        for sent, expected in cases:
            body: dict[str, object] = {"model": "m", "token_ids": [1, 2, 3]}
            if sent is not None:
                body["sampling_params"] = sent
            a = await admit(orjson.dumps(body), route, gate, RequestIds("r", None), tenant, 0.0)
            assert orjson.loads(vllm_prefill_body(a, decision))["sampling_params"] == expected
