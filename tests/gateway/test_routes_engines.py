"""The routes of vLLM's and SGLang's other APIs through the gateway, in-process against scripted
workers: render, SageMaker, Cohere and SGLang pass-through routes; `/invocations` picking its
route by body; the native generate routes keyed like completions; `model` optional on chat and
completions with one served model; the probes and the model cards."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from policies import make_policy
from tests.gateway.routes_rig import KEY, SECRET, Rig, config, routes_rig
from tests.gateway.routes_worker import ENGINE_PATHS, RoutesWorker, start
from tests.support.inprocess import gateway_in_process

# The endpoint label of each route (metrics, access log, spans).
_ENDPOINTS = {
    "/v1/chat/completions/render": "chat_render",
    "/v1/completions/render": "completions_render",
    "/v2/embed": "embeddings",
    "/encode": "embeddings",
    "/v1/classify": "classify",
    "/v1/tokenize": "tokenize",
    "/v1/detokenize": "detokenize",
    "/invocations": "invocations",
}
PROMPT = "The quick brown fox jumps over the lazy dog, again and again. " * 8  # several blocks


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig() as rig:
        yield rig


@pytest.mark.parametrize("path", ENGINE_PATHS)
async def test_engine_routes_are_passed_through_to_the_same_path(rig: Rig, path: str) -> None:
    body = {"model": "m", "input": "some text", "cache_salt": "client-chosen", "extra_key": "mine"}
    resp = await rig.client.post(path, json=body, headers=KEY)
    assert resp.status_code == 200, resp.text
    got = rig.last()
    assert got.path == path
    assert got.json() == {"model": "m", "input": "some text"}  # unsalted, as sent
    req = rig.policy.requests[-1]
    assert req.block_keys == () and req.n_prompt_tokens == len(orjson.dumps(body)) // 4
    assert rig.metric("kvgate_requests_total", endpoint=_ENDPOINTS[path], status="200", tenant="t") == 1


async def test_render_routes_are_not_keyed(rig: Rig) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
    assert (await rig.client.post("/v1/chat/completions/render", json=chat, headers=KEY)).status_code == 200
    assert rig.last().path == "/v1/chat/completions/render" and "cache_salt" not in rig.last().json()
    assert rig.policy.requests[-1].block_keys == ()
    completions = {"model": "m", "prompt": PROMPT}
    assert (await rig.client.post("/v1/completions/render", json=completions, headers=KEY)).status_code == 200
    assert rig.policy.requests[-1].block_keys == ()


async def test_invocations_route_by_body_shape(rig: Rig) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
    sent = {**chat, "extra_key": "mine"}  # SGLang joins it to `cache_salt`: the client's is dropped
    assert (await rig.client.post("/invocations", json=sent, headers=KEY)).status_code == 200
    got = rig.last()
    # Sent, keyed and salted as the chat route itself would be.
    assert got.path == "/v1/chat/completions" and "cache_salt" in got.json()
    assert "extra_key" not in got.json()
    keyed = rig.policy.requests[-1].block_keys
    assert keyed
    assert (await rig.client.post("/v1/chat/completions", json=chat, headers=KEY)).status_code == 200
    assert rig.policy.requests[-1].block_keys == keyed
    assert rig.metric("kvgate_requests_total", endpoint="chat", status="200", tenant="t") == 2

    completions = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
    assert (await rig.client.post("/invocations", json=completions, headers=KEY)).status_code == 200
    assert rig.last().path == "/v1/completions" and "cache_salt" in rig.last().json()
    assert rig.policy.requests[-1].block_keys

    # What only the worker can place (its model's pooling tasks) goes to its own /invocations.
    embed = {"model": "m", "input": "x"}
    assert (await rig.client.post("/invocations", json=embed, headers=KEY)).status_code == 200
    assert rig.last().path == "/invocations" and rig.last().json() == embed

    # The picked route's checks apply.
    resp = await rig.client.post("/invocations", json={"model": "m", "messages": []}, headers=KEY)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


async def test_native_generate_is_keyed_like_the_same_completions_prompt(rig: Rig) -> None:
    completions = {"model": "m", "prompt": PROMPT}
    assert (await rig.client.post("/v1/completions", json=completions, headers=KEY)).status_code == 200
    as_completions = rig.policy.requests[-1]
    assert as_completions.block_keys
    salt = rig.last().json()["cache_salt"]

    sglang = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    sent = {**sglang, "extra_key": "chosen-by-the-client"}
    assert (await rig.client.post("/generate", json=sent, headers=KEY)).status_code == 200
    got = rig.last()
    # The only model's pool; the body as sent, SGLang's cache isolation key (`extra_key`) set to
    # the tenant's salt in place of the client's.
    assert got.path == "/generate" and got.json() == {**sglang, "extra_key": salt}
    req = rig.policy.requests[-1]
    assert req.block_keys == as_completions.block_keys
    assert req.n_prompt_tokens == as_completions.n_prompt_tokens
    assert rig.metric("kvgate_requests_total", endpoint="generate", status="200", tenant="t") == 1

    ids = list(range(1, 200))
    assert (
        await rig.client.post("/v1/completions", json={"model": "m", "prompt": ids}, headers=KEY)
    ).status_code == 200
    by_ids = rig.policy.requests[-1].block_keys
    assert (
        await rig.client.post("/generate", json={"input_ids": ids, "stream": False}, headers=KEY)
    ).status_code == 200
    assert rig.policy.requests[-1].block_keys == by_ids
    # vLLM's token-in, token-out route: keyed the same, and salted.
    vllm = {"model": "m", "token_ids": ids, "sampling_params": {"max_tokens": 2}}
    assert (await rig.client.post("/inference/v1/generate", json=vllm, headers=KEY)).status_code == 200
    assert rig.last().path == "/inference/v1/generate" and "cache_salt" in rig.last().json()
    assert rig.policy.requests[-1].block_keys == by_ids


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {}}, "text"),
        ({"text": ""}, "text"),
        ({"input_ids": [1.5]}, "input_ids"),
        ({"text": "x", "rid": "mine"}, "rid"),
    ],
)
async def test_a_bad_native_generate_body_is_a_400(rig: Rig, body: dict[str, object], param: str) -> None:
    resp = await rig.client.post("/generate", json=body, headers=KEY)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert all(not w.received for w in rig.workers)


async def test_chat_and_completions_take_the_only_model() -> None:
    worker = RoutesWorker("w")
    runner = await start(worker)
    one = config([worker.url])
    two = {**one, "pools": [*one["pools"], {"name": "q", "models": ["m2"], "workers": [worker.url]}]}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    completions = {"prompt": "hi"}
    try:
        for raw, expected in ((one, 200), (two, 400)):
            async with gateway_in_process(raw, make_policy("round_robin"), secret=SECRET) as gw:
                for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completions)):
                    resp = await gw.client.post(path, json=body, headers=KEY)
                    assert resp.status_code == expected, resp.text
                    if expected == 400:
                        assert resp.json()["error"]["param"] == "model"
                    else:
                        assert "model" not in worker.received[-1].json()  # the worker takes its own
                # An empty name names no model either (vLLM serves its own: test_body_compat).
                resp = await gw.client.post("/v1/chat/completions", json={**chat, "model": ""}, headers=KEY)
                assert resp.status_code == expected, resp.text
    finally:
        await runner.cleanup()


async def test_ping_and_health_generate(rig: Rig) -> None:
    for method in ("GET", "POST"):
        resp = await rig.client.request(method, "/ping")
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert (await rig.client.get("/health_generate")).status_code == 200
    for w in rig.state.registry.pools["p"].workers.values():
        w.healthy = False
    assert (await rig.client.get("/ping")).status_code == 200  # liveness: the gateway's own
    assert (await rig.client.get("/health_generate")).status_code == 503
    assert all(not w.received for w in rig.workers)


async def test_model_cards_have_vllms_fields() -> None:
    worker = RoutesWorker("w")
    runner = await start(worker)
    raw = config([worker.url])
    raw["pools"][0] |= {"models": ["m", "m-sql"], "adapters": {"m-sql": "sql"}}
    try:
        async with gateway_in_process(raw, make_policy("round_robin"), secret=SECRET) as gw:
            cards = (await gw.client.get("/v1/models", headers=KEY)).json()["data"]
            assert [c["id"] for c in cards] == ["m", "m-sql"]
            base, adapter = cards
            assert base["root"] == "m" and base["parent"] is None and base["permission"] == []
            assert base["owned_by"] == "kvgate" and base["object"] == "model"
            assert adapter["parent"] == "m" and adapter["root"] == "m-sql"
            assert "max_model_len" not in base  # this worker has no cards to read (404)
            assert (await gw.client.get("/v1/models/m-sql", headers=KEY)).json() == adapter
    finally:
        await runner.cleanup()
