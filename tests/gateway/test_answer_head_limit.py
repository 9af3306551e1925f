"""A worker answer's head is bounded the same on both upstream transports
(`upstream_conn.MAX_ANSWER_HEAD_BYTES`): vLLM's binary embeddings, whose `metadata` header lists
every input's offsets, pass through well past aiohttp's default 8 KB header line (what https
workers are read with), and a head past the bound is a malformed answer on either transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from gateway.upstream_conn import MAX_ANSWER_HEAD_BYTES
from policies.base import Outcome
from tests.gateway.routes_rig import KEY, SECRET, Recording, config
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_app
from tests.support.transports import TRANSPORTS, through
from tests.support.wait import wait_until


def _metadata(inputs: int) -> str:
    """vLLM's `metadata` header for `inputs` embeddings: each input's place in the body."""
    data = [
        {"index": i, "object": "embedding", "start": i * 4096, "end": (i + 1) * 4096} for i in range(inputs)
    ]
    return orjson.dumps({"id": "embd-1", "object": "list", "model": "m", "data": data}).decode()


@contextlib.asynccontextmanager
async def embeddings_worker(metadata: str) -> AsyncIterator[str]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def embeddings(_: web.Request) -> web.Response:
        headers = {"metadata": metadata}
        return web.Response(body=b"\0" * 64, content_type="application/octet-stream", headers=headers)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/embeddings", embeddings)
    runner, port = await serve_app(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(url: str, transport: str) -> AsyncIterator[tuple[InProcessGateway, Recording]]:
    policy = Recording()
    async with gateway_in_process(config([url]), policy, secret=SECRET) as gw:
        pool = gw.state.registry.pools["p"]
        await wait_until(lambda: all(w.healthy for w in pool.workers.values()))
        through(gw.state, transport)
        yield gw, policy


_BODY = {"model": "m", "input": ["x"], "encoding_format": "bytes"}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_large_metadata_header_passes_through(transport: str) -> None:
    metadata = _metadata(2000)
    assert 8 * 1024 < len(metadata) < MAX_ANSWER_HEAD_BYTES // 2
    async with embeddings_worker(metadata) as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post("/v1/embeddings", json=_BODY, headers=KEY)
        assert resp.status_code == 200, resp.text
        assert resp.headers["metadata"] == metadata
        assert resp.headers["content-type"] == "application/octet-stream"
        (obs,) = policy.observations
        assert obs.outcome is Outcome.SERVED


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_head_past_the_bound_is_a_malformed_answer(transport: str) -> None:
    metadata = "x" * (MAX_ANSWER_HEAD_BYTES + 1)
    async with embeddings_worker(metadata) as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post("/v1/embeddings", json=_BODY, headers=KEY)
        assert resp.status_code == 502, resp.text
        assert orjson.loads(resp.content)["error"]["code"] == "bad_gateway"
        (obs,) = policy.observations
        assert obs.outcome is Outcome.WORKER_FAILED
