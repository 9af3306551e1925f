"""A `GET` or `cancel` of a stored response that waits on its worker (a slow holder, a search
through workers that do not answer) ends when its client leaves, and at the drain deadline, as a
proxied request does: the worker's request is closed, the tenant's slot given back, the request
counted once (499 when the client left; 503 `gateway_shutting_down` answered at the deadline)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.app import GatewayApp, drain
from gateway.auth import hash_api_key
from gateway.state import GatewayState
from policies import make_policy
from tests.support.inprocess import gateway_in_process
from tests.support.leaving_client import leaving_request
from tests.support.loopback import serve_app
from tests.support.wait import wait_until

SECRET = b"retrieve-ends"
KEY = b"Bearer sk"


@dataclass
class SlowHolder:
    """Creates responses; holds every `GET` and `cancel` of one until the test ends, noting the
    requests the gateway closed before their answer."""

    waiting: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/responses", self._create)
        app.router.add_get("/v1/responses/{rid}", self._hold)
        app.router.add_post("/v1/responses/{rid}/cancel", self._hold)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"id": body["request_id"], "object": "response", "status": "completed"})

    async def _hold(self, request: web.Request) -> web.Response:
        self.waiting.append(request.path)
        try:
            await asyncio.Event().wait()
        finally:
            self.closed.append(request.path)
        raise AssertionError("unreachable")


@dataclass
class Stack:
    app: GatewayApp
    state: GatewayState
    client: httpx.AsyncClient
    worker: SlowHolder

    def counted(self, endpoint: str) -> list[str]:
        metrics = self.state.routing.metrics.render().decode().splitlines()
        prefix = "kvgate_requests_total{"
        return [m for m in metrics if m.startswith(prefix) and f'endpoint="{endpoint}"' in m]


@contextlib.asynccontextmanager
async def stack() -> AsyncIterator[Stack]:
    worker = SlowHolder()
    runner, port = await serve_app(worker.app(), handler_cancellation=True)
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{port}"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "scrape": {"enabled": False},
    }
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            yield Stack(gw.app, gw.state, gw.client, worker)
    finally:
        await runner.cleanup()


def _request(
    app: GatewayApp, method: str, path: str
) -> tuple[asyncio.Future[None], asyncio.Event, list[MutableMapping[str, Any]]]:
    """`app` running one request whose client disconnects once the returned event is set; what
    the app sent, in order."""
    sent: list[MutableMapping[str, Any]] = []
    task, leave = leaving_request(app, method, path, [(b"authorization", KEY), (b"host", b"gw")], b"", sent)
    return task, leave, sent


async def _created(s: Stack) -> str:
    resp = await s.client.post(
        "/v1/responses", json={"model": "m", "input": "hi"}, headers={"authorization": "Bearer sk"}
    )
    assert resp.status_code == 200
    rid: str = resp.json()["id"]
    return rid


@pytest.mark.parametrize(
    ("method", "suffix", "endpoint"),
    [("GET", "", "responses.retrieve"), ("POST", "/cancel", "responses.cancel")],
)
async def test_a_client_leaving_a_waiting_retrieve_closes_the_workers_request(
    method: str, suffix: str, endpoint: str
) -> None:
    async with stack() as s:
        path = f"/v1/responses/{await _created(s)}{suffix}"
        task, leave, _ = _request(s.app, method, path)
        await wait_until(lambda: s.worker.waiting == [path])
        leave.set()
        await wait_until(lambda: s.worker.closed == [path], what="the worker's request closed")
        await wait_until(lambda: s.state.gate.limiters["t"].in_flight == 0, what="the slot back")
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        (line,) = s.counted(endpoint)
        assert 'status="499"' in line and line.endswith(" 1.0")


async def test_the_drain_deadline_answers_a_waiting_retrieve_503() -> None:
    async with stack() as s:
        path = f"/v1/responses/{await _created(s)}"
        task, _, sent = _request(s.app, "GET", path)
        await wait_until(lambda: s.worker.waiting == [path])
        await drain(s.state, 0.0)
        await asyncio.wait_for(task, 5)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
        body = orjson.loads(b"".join(m.get("body", b"") for m in sent[1:]))
        assert body["error"]["code"] == "gateway_shutting_down"
        await wait_until(lambda: s.worker.closed == [path], what="the worker's request closed")
        assert s.state.gate.limiters["t"].in_flight == 0
        (line,) = s.counted("responses.retrieve")
        assert 'status="503"' in line and line.endswith(" 1.0")
