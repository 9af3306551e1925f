"""A stored-response `GET` whose worker refuses the gateway's credentials: the pool's worker key is
wrong, never the client's, and the answer says so (502 `worker_auth_failed`), whether the holder
is known or searched for, instead of the client's 401 or a response "not found"."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.config import parse_config
from policies import make_policy
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_app

SECRET = b"k"


@asynccontextmanager
async def _refusing_worker(status: int) -> AsyncIterator[InProcessGateway]:
    """A gateway in front of one worker that refuses every stored-response route with `status`."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Unauthorized"}}, status=status)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/responses/{rid}", refuse)
    app.router.add_post("/v1/responses", refuse)
    runner, port = await serve_app(app)
    config = parse_config(
        {
            "pools": [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{port}"]}],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
            "scrape": {"enabled": False},
        }
    )
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            yield gw
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("known", [False, True])
async def test_a_worker_refusing_the_gateways_key_is_a_502_not_the_clients_401(
    status: int, known: bool
) -> None:
    async with _refusing_worker(status) as gw:
        rid = gw.state.gate.responses.ids.mint("t")
        if known:
            (worker,) = gw.state.registry.pools["p"].workers.values()
            gw.state.gate.responses.learn(rid, "t", "p", worker.worker_id, time.monotonic())
        resp = await gw.client.get(f"/v1/responses/{rid}", headers={"authorization": "Bearer sk"})
        assert resp.status_code == 502
        error = resp.json()["error"]
        assert error["code"] == "worker_auth_failed" and f"HTTP {status}" in error["message"]


async def test_a_follow_up_whose_search_meets_a_refusing_worker_is_a_502() -> None:
    async with _refusing_worker(401) as gw:
        rid = gw.state.gate.responses.ids.mint("t")
        body = {"model": "m", "input": "hi", "previous_response_id": rid}
        resp = await gw.client.post("/v1/responses", json=body, headers={"authorization": "Bearer sk"})
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "worker_auth_failed"
