"""A worker's 200 in another content type than JSON: vLLM's binary embeddings are an answer
(`binary_answer` routes), while on every other JSON route (chat, completions, ...) it is a broken
answer (an HTML error page of a proxy in front of the worker), counted against the worker and
never passed to the client as a success; on both upstream transports."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from gateway.routes import ROUTES
from policies.base import Outcome
from tests.gateway.answer_rig import answering, gateway
from tests.gateway.routes_rig import KEY
from tests.support.transports import TRANSPORTS

HTML = b"<html>502 upstream proxy error</html>"
BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/embeddings": {"model": "m", "input": "hi", "encoding_format": "bytes"},
    "/invocations": {"model": "m", "input": "hi", "encoding_format": "bytes"},  # SageMaker's, pooling
}


def test_only_vllm_s_binary_embeddings_routes_answer_other_formats() -> None:
    binary = {"/v1/embeddings", "/pooling", "/invocations"}
    assert {p for p, r in ROUTES.items() if r.binary_answer} == binary


def worker(body: bytes, content_type: str) -> contextlib.AbstractAsyncContextManager[str]:
    """A worker that answers every POST of BODIES with `body` in `content_type`."""
    return answering(BODIES, body, {"content-type": content_type})


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_an_html_page_is_a_broken_answer_on_a_json_route(path: str, transport: str) -> None:
    async with worker(HTML, "text/html; charset=utf-8") as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post(path, json=BODIES[path], headers=KEY)
        assert resp.status_code == 502, resp.text
        error = orjson.loads(resp.content)["error"]
        assert error["code"] == "bad_gateway" and "text/html" in error["message"]
        (obs,) = policy.observations
        assert obs.outcome is Outcome.WORKER_FAILED
        worker_state = next(iter(gw.state.registry.pools["p"].workers.values()))
        assert worker_state.breaker.failures == 1 and worker_state.in_flight == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("path", ["/v1/embeddings", "/invocations"])
async def test_binary_embeddings_are_an_answer_and_html_is_not(path: str, transport: str) -> None:
    vectors = bytes(range(16))
    async with worker(vectors, "application/octet-stream") as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post(path, json=BODIES[path], headers=KEY)
        assert resp.status_code == 200 and resp.content == vectors
        assert resp.headers["content-type"] == "application/octet-stream"
        (obs,) = policy.observations
        assert obs.outcome is Outcome.SERVED
    async with worker(HTML, "text/html") as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post(path, json=BODIES[path], headers=KEY)
        assert resp.status_code == 502
        (obs,) = policy.observations
        assert obs.outcome is Outcome.WORKER_FAILED
