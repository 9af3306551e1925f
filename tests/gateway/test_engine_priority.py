"""The engines' `priority`: vLLM (`--scheduling-policy priority`) and SGLang (priority scheduling)
order every tenant's requests in one queue by it, so the operator places each tenant there
(`tenants[].engine_priority`) on the pools whose engines schedule by it (`priority_scheduling`).
A client's own `priority` orders its tenant's requests in the gateway's queue alone: on no route
and no P/D leg does it reach a worker as sent."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import helm_python
import orjson
import pytest
from aiohttp import web

from gateway.admission import admit
from gateway.admitted import Admitted
from gateway.auth import hash_api_key
from gateway.bodies import parse_form, with_priority
from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.errors import ApiError
from gateway.gate import Gate
from gateway.pd_bodies import sglang_bodies, vllm_decode_body, vllm_prefill_body
from gateway.request_head import RequestIds
from gateway.routes import ROUTES
from policies import make_policy
from policies.base import RouteDecision, WorkerId
from tests.helm.chart import POOL, TENANT, gateway_config, render
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app

SECRET = b"k"
# A tenant placed ahead of the others, whose clients may send their own requests back by up to 5;
# and a tenant with the defaults (at 0, its clients cannot move at the engine).
PAYING = {"base": -10, "client_min": 0, "client_max": 5}
TENANTS: list[dict[str, Any]] = [
    {"name": "paying", "api_key_hashes": [hash_api_key(SECRET, "sk-paying")], "engine_priority": PAYING},
    {"name": "free", "api_key_hashes": [hash_api_key(SECRET, "sk-free")]},
]
JUMP = -1_000_000  # a client trying to go before everyone at the engine

GENERATING: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/v1/messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 4}},  # SGLang's native route
    "/inference/v1/generate": {"model": "m", "token_ids": [1, 2, 3]},  # vLLM's token-in route
}
OTHERS: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": "m", "input": "hi"},
    "/v1/rerank": {"model": "m", "query": "q", "documents": ["d"]},
    "/tokenize": {"model": "m", "prompt": "hi"},
}
DECISION = RouteDecision(WorkerId("http://127.0.0.1:9"), 0.0, "test")


def _config(scheduling: str, workers: list[str] | None = None) -> dict[str, Any]:
    pool = {
        "name": "p",
        "models": ["m"],
        "workers": workers or ["http://127.0.0.1:9"],
        "priority_scheduling": scheduling,
        "health": {"timeout_s": 0.2},
    }
    return {"pools": [pool], "tenants": TENANTS, "scrape": {"enabled": False}}


@contextlib.asynccontextmanager
async def _gate(scheduling: str) -> AsyncIterator[Gate]:
    async with gateway_in_process(
        _config(scheduling), make_policy("round_robin"), secret=SECRET, workers_up=False
    ) as gw:
        yield gw.state.gate


async def _admit(gate: Gate, path: str, tenant: str, body: dict[str, Any]) -> Admitted:
    ids = RequestIds(f"req-{tenant}", None)
    return await admit(orjson.dumps(body), ROUTES[path], gate, ids, gate.keyring.tenants[tenant], 0.0)


def _sent(a: Admitted) -> dict[str, Any]:
    """The body one dispatch of `a` sends to its worker."""
    out: dict[str, Any] = orjson.loads(a.body_for(DECISION))
    return out


@pytest.mark.parametrize("path", [*GENERATING, *OTHERS])
async def test_a_clients_priority_never_reaches_engines_that_do_not_schedule_by_it(path: str) -> None:
    body = {**GENERATING.get(path, OTHERS.get(path, {})), "priority": JUMP}
    async with _gate("off") as gate:
        for tenant in ("paying", "free"):
            a = await _admit(gate, path, tenant, body)
            assert "priority" not in _sent(a) and "priority" not in a.forward
            # Still orders the tenant's own requests in the gateway's queue, on routes whose model
            # has the field (Messages and the tokenizer routes have none: neither checked nor read).
            assert a.priority == (JUMP if ROUTES[path].has_priority else 0)


@pytest.mark.parametrize(
    ("scheduling", "sign"), [("lower_first", 1), ("higher_first", -1)], ids=["vllm", "sglang-default"]
)
@pytest.mark.parametrize("path", list(GENERATING))
async def test_generating_routes_carry_the_tenants_engine_priority(
    path: str, scheduling: str, sign: int
) -> None:
    # The client's value clamped to its tenant's band, added to the tenant's base; in the engine's
    # own direction (SGLang's default serves higher values first).
    cases = [("paying", JUMP, -10), ("paying", 3, -7), ("paying", 99, -5), ("free", JUMP, 0), ("free", 7, 0)]
    read = ROUTES[path].has_priority  # Messages has no such field: the client's is not read
    async with _gate(scheduling) as gate:
        for tenant, client, expected in cases:
            if not read:
                expected = -10 if tenant == "paying" else 0  # as if the client sent none
            a = await _admit(gate, path, tenant, {**GENERATING[path], "priority": client})
            assert _sent(a)["priority"] == sign * expected, (tenant, client)
            assert a.forward["priority"] == sign * expected
            assert a.priority == (client if read else 0)
        # A client that sends none still gets its tenant's place (SGLang puts a request without
        # one after every request with one).
        for tenant, expected in (("paying", -10), ("free", 0)):
            assert _sent(await _admit(gate, path, tenant, GENERATING[path]))["priority"] == sign * expected


@pytest.mark.parametrize("path", list(OTHERS))
async def test_routes_that_do_not_generate_carry_no_priority(path: str) -> None:
    async with _gate("lower_first") as gate:
        a = await _admit(gate, path, "paying", {**OTHERS[path], "priority": JUMP})
        assert "priority" not in _sent(a) and "priority" not in a.forward


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
async def test_pd_legs_carry_the_tenants_priority(path: str) -> None:
    for scheduling, paying in (("off", None), ("lower_first", -10)):
        async with _gate(scheduling) as gate:
            a = await _admit(gate, path, "paying", {**GENERATING[path], "priority": JUMP, "stream": True})
            legs = [
                vllm_prefill_body(a, DECISION),
                vllm_decode_body(a, DECISION, {"remote_block_ids": [1]}),
                *sglang_bodies(
                    a, DECISION, {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2}
                ),
            ]
            for leg in legs:
                assert orjson.loads(leg).get("priority") == paying, (scheduling, leg)


def test_a_body_is_rewritten_only_when_its_priority_changes() -> None:
    body = {"model": "m", "messages": []}
    encoded = orjson.dumps(body)
    assert with_priority(body, encoded, None) == (body, encoded)
    assert with_priority(body, encoded, None)[0] is body
    same = {**body, "priority": 4}
    assert with_priority(same, orjson.dumps(same), 4)[0] is same
    added, added_bytes = with_priority(body, encoded, -3)
    assert added == {**body, "priority": -3} and orjson.loads(added_bytes) == added
    assert "priority" not in body  # the caller's dict is left alone
    for client in (JUMP, 0):
        sent = {**body, "priority": client}
        out, out_bytes = with_priority(sent, orjson.dumps(sent), None)
        assert out == body and orjson.loads(out_bytes) == body


@contextlib.asynccontextmanager
async def _capturing_worker() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        usage = {"prompt_tokens": 5, "completion_tokens": 1}
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [], "usage": usage})

    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        await runner.cleanup()


async def test_the_worker_gets_the_tenants_priority_through_the_gateway() -> None:
    # Small bodies are read inline, large ones (over 256 KiB) by the keying process: both ways.
    small = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": JUMP}
    large = {**small, "messages": [{"role": "user", "content": "x " * 200_000}]}
    for scheduling, expected in (
        ("off", {"paying": None, "free": None}),
        ("lower_first", {"paying": -10, "free": 0}),
    ):
        async with (
            _capturing_worker() as (url, bodies),
            gateway_in_process(_config(scheduling, [url]), make_policy("round_robin"), secret=SECRET) as gw,
        ):
            for tenant in ("paying", "free"):
                for body in (small, large):
                    headers = {"authorization": f"Bearer sk-{tenant}"}
                    resp = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
                    assert resp.status_code == 200, resp.text
                    assert bodies[-1].get("priority") == expected[tenant], (scheduling, tenant, len(bodies))
            assert len(bodies) == 4


@pytest.mark.parametrize(
    ("band", "error"),
    [
        ({"client_min": 3, "client_max": 1}, ": Value error, client_min (3) is above client_max (1)"),
        ({"base": 10**9}, ".base: Input should be less than or equal to 1000000"),
        ({"lowest": 0}, ".lowest: Extra inputs are not permitted"),
    ],
)
def test_a_bad_engine_priority_is_refused_at_load(band: dict[str, int], error: str) -> None:
    tenants = [{**TENANTS[1], "engine_priority": band}]
    with pytest.raises(ConfigError, match=re.escape(f"tenants.0.engine_priority{error}")):
        parse_config({**_config("lower_first"), "tenants": tenants})


def test_a_form_body_cannot_carry_a_priority() -> None:
    # A form is forwarded as the client sent it, so its priority could not be replaced.
    boundary = "b0undary"
    parts = [("model", "m"), ("priority", str(JUMP))]
    raw = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in parts
    )
    raw += f"--{boundary}--\r\n".encode()
    content_type = f"multipart/form-data; boundary={boundary}"
    with pytest.raises(ApiError) as refused:
        parse_form(raw, content_type, ROUTES["/v1/audio/transcriptions"])
    assert refused.value.status == 400 and refused.value.param == "priority"
    assert parse_form(
        raw.replace(b'name="priority"', b'name="language"'), content_type, ROUTES["/v1/audio/transcriptions"]
    )


def test_the_chart_renders_a_tenants_engine_priority() -> None:
    pool = {**POOL, "extra": {"priority_scheduling": "lower_first", "max_model_len": 32768}}
    docs = render({"pools": [pool], "tenants": [TENANT | {"enginePriority": PAYING}]})
    cfg = parse_config(gateway_config(docs))  # `kvgate serve` accepts what the chart renders
    assert cfg.tenants[0].engine_priority.value(JUMP) == -10
    assert cfg.pools[0].priority_scheduling == "lower_first" and cfg.pools[0].max_model_len == 32768
    with pytest.raises(helm_python.HelmError, match="/tenants/0/enginePriority"):
        render({"pools": [POOL], "tenants": [TENANT | {"enginePriority": {"lowest": 0}}]})
