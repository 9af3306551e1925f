"""A busy worker holding a stored response (its 503, or its 529 "overloaded") is told to a client
of `GET /v1/responses/{id}` and of its `cancel` as the proxied routes tell a busy worker: 503 with
the worker's own `Retry-After` (the gateway's 1 s when it sent none), code `worker_unavailable` for
its 503 and `worker_overloaded` for its 529, and counted so. Before, the worker's status was
passed through, 529 included, which no OpenAI client knows, and its `Retry-After` was dropped.

The gateway runs in-process in front of a scripted worker on 127.0.0.1 that stores responses and
answers every read of one with the status the test sets."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from gateway.responses_routes import CANCEL_ENDPOINT, RETRIEVE_ENDPOINT
from policies.baselines import RoundRobin
from tests.support.gateway_config import SECRET, tenant
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import healthy, serve_in
from tests.support.metrics import metric_total

KEY = {"authorization": "Bearer sk-a"}
USAGE = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}


@dataclass
class BusyHolder:
    """Creates responses; answers a retrieve or cancel of one with `status`, carrying
    `Retry-After` when `retry_after` is set."""

    status: int = 200
    retry_after: str | None = None
    reads: list[str] = field(default_factory=list)

    async def create(self, request: web.Request) -> web.Response:
        rid = (await request.json())["request_id"]
        return web.json_response({"id": rid, "object": "response", "status": "completed", "usage": USAGE})

    async def read(self, request: web.Request) -> web.Response:
        self.reads.append(request.path)
        headers = {} if self.retry_after is None else {"Retry-After": self.retry_after}
        body = {"error": {"message": "Server busy, try again later", "type": "ServiceUnavailable"}}
        return web.json_response(body, status=self.status, headers=headers)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", healthy)
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{rid}", self.read)
        app.router.add_post("/v1/responses/{rid}/cancel", self.read)
        return app


@contextlib.asynccontextmanager
async def _gateway(worker: BusyHolder) -> AsyncIterator[InProcessGateway]:
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_in(stack, worker.app())
        pool = {"name": "p", "models": ["m"], "workers": [url]}
        config = {"pools": [pool], "tenants": [tenant("a", "sk-a")], "scrape": {"enabled": False}}
        async with gateway_in_process(config, RoundRobin(), secret=SECRET) as gw:
            yield gw


@pytest.mark.parametrize(("status", "code"), [(503, "worker_unavailable"), (529, "worker_overloaded")])
@pytest.mark.parametrize("retry_after", ["3", None])
async def test_a_busy_holder_is_a_503_with_its_retry_after(
    status: int, code: str, retry_after: str | None
) -> None:
    worker = BusyHolder()
    async with _gateway(worker) as gw:
        created = await gw.client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=KEY)
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        worker.status, worker.retry_after = status, retry_after
        for method, path, endpoint in (
            ("GET", f"/v1/responses/{rid}", RETRIEVE_ENDPOINT),
            ("POST", f"/v1/responses/{rid}/cancel", CANCEL_ENDPOINT),
        ):
            answer = await gw.client.request(method, path, headers=KEY)
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", code)
            assert answer.headers["retry-after"] == (retry_after or "1")
            assert answer.headers["x-request-id"]
            assert metric_total(gw.state, "kvgate_requests_total", endpoint=endpoint, status="503") == 1
        assert worker.reads == [f"/v1/responses/{rid}", f"/v1/responses/{rid}/cancel"]
