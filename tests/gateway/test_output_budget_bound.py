"""A client's output budget (`max_tokens`, `max_completion_tokens`, `max_output_tokens`) enters its
worker's load (`Worker.acquire`, `reserve`: `in_flight_decode_tokens`) and the request's own
`RouteRequest.max_output_tokens`, which the cost policy and the P/D chooser turn into seconds. Any
integer passes JSON, so one request asking for 10**15 tokens would make its worker look busy for
years while it lives (a slowly read stream keeps it alive): counted whole, it takes the worker out
of rotation for every tenant. It counts for at most the pool's context window."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.admission import admit
from gateway.admitted import Admitted
from gateway.auth import hash_api_key
from gateway.bodies import ASSUMED_MAX_MODEL_LEN
from gateway.config.pool import PoolConfig
from gateway.gate import Gate
from gateway.request_head import RequestIds
from gateway.routes import ROUTES
from gateway.worker import Worker
from policies import make_policy
from policies.base import Observation, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from policies.pd import PdRouter, PdSettings
from tests.policies.factories import req
from tests.support.inprocess import InProcessGateway, gateway_in_process

SECRET = b"k"
HUGE = 10**15
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def _gateway(**pool: Any) -> AsyncIterator[InProcessGateway]:
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"], **pool}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "scrape": {"enabled": False},
    }
    async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET, workers_up=False) as gw:
        yield gw


async def _admit(gate: Gate, body: dict[str, Any], path: str = "/v1/chat/completions") -> Admitted:
    tenant = gate.keyring.tenants["t"]
    return await admit(orjson.dumps(body), ROUTES[path], gate, RequestIds("r", None), tenant, 0.0)


def _workers(n: int, **roles: str) -> list[Worker]:
    config = PoolConfig(name="p", models=["m"], workers=["http://x"])
    workers = [Worker(f"http://w{i}", config) for i in range(n)]
    for w in workers:
        w.healthy = True
        w.role = roles.get(w.url.removeprefix("http://"))
    return workers


async def test_a_huge_budget_counts_for_at_most_the_assumed_window() -> None:
    async with _gateway() as gw:
        for name in ("max_tokens", "max_completion_tokens"):
            a = await _admit(gw.state.gate, {**CHAT, name: HUGE})
            assert a.max_output_tokens == a.route.max_output_tokens == ASSUMED_MAX_MODEL_LEN
        a = await _admit(
            gw.state.gate, {"model": "m", "input": "hi", "max_output_tokens": HUGE}, "/v1/responses"
        )
        assert a.max_output_tokens == ASSUMED_MAX_MODEL_LEN
        assert (await _admit(gw.state.gate, {**CHAT, "max_tokens": 512})).max_output_tokens == 512
        assert (await _admit(gw.state.gate, CHAT)).max_output_tokens == 0
        # The native generate routes take theirs in `sampling_params` (vLLM's `max_tokens`,
        # SGLang's `max_new_tokens`): counted the same way.
        native = [
            ("/inference/v1/generate", {"model": "m", "token_ids": [1, 2, 3]}, "max_tokens"),
            ("/generate", {"model": "m", "text": "hi"}, "max_new_tokens"),
        ]
        for path, body, name in native:
            for budget, counted in ((64, 64), (HUGE, ASSUMED_MAX_MODEL_LEN)):
                native_body = {**body, "sampling_params": {name: budget}}
                assert (await _admit(gw.state.gate, native_body, path)).max_output_tokens == counted
        # What the worker is sent is the client's own: the worker judges it (vLLM answers 400).
        assert orjson.loads(a.encoded)["max_output_tokens"] == HUGE


async def test_one_huge_request_does_not_move_others_off_their_cached_prefix() -> None:
    # w0 holds a 2k-token prefix; every worker decodes four ordinary requests. The next request of
    # that prefix goes to w0 (a hit), also while a request asking for 10**15 tokens runs there.
    # Counted whole, that request made w0's queue 5.2e7 s and the hit went to another worker.
    policy = CostPolicy(seed=1)
    warm = req("warm", range(128))
    decision = policy.select(warm, [WorkerView(WorkerId("http://w0"))], 0.0)
    assert decision is not None
    policy.on_dispatch(warm, decision, 0.0)
    policy.on_complete(
        Observation(warm, decision.worker, ttft_s=None, prompt_tokens=warm.n_prompt_tokens), 0.0
    )
    workers = _workers(4)
    for w in workers:
        for _ in range(4):
            w.acquire(1000, 512, 0.0)
            w.first_token(1000, 512, now_s=0.0)
    async with _gateway() as gw:
        a = await _admit(gw.state.gate, {**CHAT, "max_tokens": HUGE, "stream": True})
    workers[0].acquire(a.route.n_prompt_tokens, a.max_output_tokens, 1.0)
    workers[0].first_token(a.route.n_prompt_tokens, a.max_output_tokens, now_s=1.0)
    views = [w.view(1.0) for w in workers]
    hit = req("hit", range(130))
    chosen = policy.select(hit, views, 1.0)
    assert chosen is not None and chosen.worker == "http://w0" and chosen.reason == "hit"
    assert policy.cost_model(hit).queue_s(views[0], 2000, now_s=1.0) < 0.01


async def test_a_huge_budget_weighs_on_a_decode_worker_no_more_than_a_full_batch() -> None:
    # P/D decode placement: d0 decodes one request asking for 10**15 tokens, d1 64 ordinary ones
    # (2048 tokens each, as many tokens as the window in all). d0 is the lighter: it decodes the
    # next request. Counted whole, the one request kept d0 out of every decision.
    async with _gateway() as gw:
        a = await _admit(gw.state.gate, {**CHAT, "max_tokens": HUGE})
    workers = _workers(3, w0="prefill", w1="decode", w2="decode")
    workers[1].reserve(a.max_output_tokens, 0.0)
    for _ in range(64):
        workers[2].reserve(2048, 0.0)
    chosen = PdRouter(PdSettings()).select(
        CostPolicy(seed=1), req("r", range(64)), [w.view(1.0) for w in workers], 1.0
    )
    assert chosen is not None and chosen.decode.worker == "http://w1"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 4097}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": HUGE}, "max_completion_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": HUGE}, "max_tokens"),
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ],
)
async def test_a_budget_past_a_stated_window_is_refused(path: str, body: dict[str, Any], param: str) -> None:
    # vLLM refuses a budget greater than the window ("max_tokens=4097 cannot be greater than
    # max_model_len=4096"), and shortens one up to it to what the prompt leaves.
    async with _gateway(max_model_len=4096) as gw:
        resp = await gw.client.post(path, json=body, headers={"authorization": "Bearer sk"})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == param and error["code"] == "integer_above_max_value"
        assert f"'{param}' is too large: {body[param]}" in error["message"]
        assert "maximum context length is 4096 tokens" in error["message"]
        assert gw.state.gate.limiters["t"].in_flight == 0
        # Within the window it is admitted and counted whole; the whole window, as the window less
        # the prompt's one token at least (what vLLM shortens it to, at most).
        a = await _admit(gw.state.gate, {**body, param: 4095}, path)
        assert a.max_output_tokens == 4095
        a = await _admit(gw.state.gate, {**body, param: 4096}, path)
        assert a.max_output_tokens == 4095 and a.route.max_output_tokens == 4095


async def test_a_messages_budget_past_the_window_is_refused_in_anthropics_shape() -> None:
    body = {"model": "m", "max_tokens": 9000, "messages": [{"role": "user", "content": "hi"}]}
    async with _gateway(max_model_len=4096) as gw:
        resp = await gw.client.post("/v1/messages", json=body, headers={"x-api-key": "sk"})
    assert resp.status_code == 400
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "'max_tokens' is too large: 9000" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "counted"),
    [
        # completions and Messages read `max_tokens` only; Responses `max_output_tokens` only: a
        # field the route's engine ignores must not be the one counted.
        (
            "/v1/completions",
            {"model": "m", "prompt": "hi", "max_completion_tokens": 1, "max_tokens": 4000},
            4000,
        ),
        ("/v1/messages", {**CHAT, "max_completion_tokens": 1, "max_tokens": 4000}, 4000),
        ("/v1/responses", {"model": "m", "input": "hi", "max_tokens": 1, "max_output_tokens": 4000}, 4000),
        ("/v1/responses", {"model": "m", "input": "hi", "max_tokens": 4000}, 0),
        # chat takes `max_completion_tokens`, else `max_tokens`, as vLLM and SGLang do
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 300, "max_tokens": 4000}, 300),
        # one route kind serves both engines' generate fields: the larger counts
        (
            "/generate",
            {"model": "m", "text": "hi", "sampling_params": {"max_tokens": 1, "max_new_tokens": 900}},
            900,
        ),
    ],
)
async def test_the_budget_counted_is_the_one_the_routes_engine_reads(
    path: str, body: dict[str, Any], counted: int
) -> None:
    async with _gateway() as gw:
        assert (await _admit(gw.state.gate, body, path)).max_output_tokens == counted


async def test_every_choice_counts_its_own_budget() -> None:
    async with _gateway() as gw:
        gate = gw.state.gate
        assert (await _admit(gate, {**CHAT, "max_tokens": 100, "n": 8})).max_output_tokens == 800
        completion = {"model": "m", "prompt": "hi", "max_tokens": 100, "n": 2, "best_of": 5}
        assert (await _admit(gate, completion, "/v1/completions")).max_output_tokens == 500
        native = {"model": "m", "text": "hi", "sampling_params": {"max_new_tokens": 100, "n": 4}}
        assert (await _admit(gate, native, "/generate")).max_output_tokens == 400


@pytest.mark.parametrize("path", ["/generate", "/inference/v1/generate"])
async def test_the_native_routes_choices_are_bounded_like_the_others(path: str) -> None:
    body = {"model": "m", "text": "hi", "token_ids": [1, 2], "sampling_params": {"n": 100_000}}
    async with _gateway() as gw:
        resp = await gw.client.post(path, json=body, headers={"authorization": "Bearer sk"})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "sampling_params.n" and error["code"] == "integer_above_max_value"
        assert gw.state.gate.limiters["t"].in_flight == 0
