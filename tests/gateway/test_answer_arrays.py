"""Routes whose answer may be a JSON array (`answer_may_be_array`: vLLM's completions render,
SGLang's batch `/generate` and `/encode`) pass an array through, still count a 200 that is not
JSON as a malformed worker answer, and keep reading usage from object answers; on both upstream
transports. The completions render is answered by a real emulated worker, the rest by a small
scripted one."""

from __future__ import annotations

import contextlib
from typing import Any

import orjson
import pytest

from gateway.routes import ROUTES
from policies.base import Outcome
from tests.gateway.answer_rig import answering, gateway
from tests.gateway.routes_rig import KEY
from tests.support.transports import TRANSPORTS

ARRAY_ROUTES = ("/v1/completions/render", "/generate", "/encode")
_USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


def test_the_array_routes_are_the_ones_that_may_answer_one() -> None:
    assert {p for p, r in ROUTES.items() if r.answer_may_be_array} == set(ARRAY_ROUTES)
    assert all(ROUTES[p].json_answer for p in ARRAY_ROUTES)  # the malformed-answer check holds


def scripted(answer: bytes) -> contextlib.AbstractAsyncContextManager[str]:
    """A worker that answers every POST of ARRAY_ROUTES with `answer`, as JSON."""
    return answering(ARRAY_ROUTES, answer, {"content-type": "application/json"})


def _body(path: str) -> dict[str, Any]:
    return {"/generate": {"text": ["a", "b"]}, "/encode": {"text": ["a", "b"]}}.get(
        path, {"prompt": ["a", "b"]}
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_emulator_s_completions_render_array_is_passed_through(
    emulator: str, transport: str
) -> None:
    async with gateway(emulator, transport) as (gw, policy):
        body = {"model": "m", "prompt": ["one prompt", "another prompt"]}
        resp = await gw.client.post("/v1/completions/render", json=body, headers=KEY)
        assert resp.status_code == 200, resp.text
        renders = orjson.loads(resp.content)
        assert isinstance(renders, list) and len(renders) == 2
        (obs,) = policy.observations
        assert obs.outcome is Outcome.SERVED and obs.prompt_tokens is None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("path", ARRAY_ROUTES)
async def test_an_answer_that_is_not_json_is_malformed_on_the_array_routes(path: str, transport: str) -> None:
    garbage = b"<html>502 from a proxy in front of the worker</html>"
    async with scripted(garbage) as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post(path, json={"model": "m", **_body(path)}, headers=KEY)
        assert resp.status_code == 502, resp.text
        error = orjson.loads(resp.content)["error"]
        assert error["code"] == "bad_gateway"
        assert error["message"] == "worker sent a malformed answer (its body is not a JSON object or array)"
        (obs,) = policy.observations
        assert obs.outcome is Outcome.WORKER_FAILED
        worker = next(iter(gw.state.registry.pools["p"].workers.values()))
        assert worker.breaker.failures == 1 and worker.in_flight == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_json_scalar_is_malformed_and_an_object_s_usage_is_counted(transport: str) -> None:
    async with scripted(b'"just a string"') as url, gateway(url, transport) as (gw, _):
        resp = await gw.client.post("/encode", json={"model": "m", "text": "a"}, headers=KEY)
        assert resp.status_code == 502
    answer = orjson.dumps({"text": "hi", "meta_info": {}, "usage": _USAGE})
    async with scripted(answer) as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post("/generate", json={"model": "m", "text": "a"}, headers=KEY)
        assert resp.status_code == 200 and resp.content == answer
        (obs,) = policy.observations
        assert obs.outcome is Outcome.SERVED
        assert (obs.prompt_tokens, obs.completion_tokens) == (7, 2)
