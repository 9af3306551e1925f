"""`GET /v1/responses/render` is what vLLM makes of it: a retrieve of a stored response whose id is
`render` (vLLM's `GET /v1/responses/{response_id}` takes any one path segment as an id), answered
with vLLM's 404 for a response it does not hold, naming `response_id`. The gateway answered 405
(`method_not_allowed`), as if the path were only vLLM 0.33's `POST /v1/responses/render`: a client
that retrieves a response by an id it was given would read that as the gateway refusing the
method. Every other method there is still 405, a POST still renders, and a GET of a proxied path
no response id could be is still 405.

The gateway runs in-process in front of a scripted worker on 127.0.0.1 that renders and stores."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from gateway.responses_routes import RETRIEVE_ENDPOINT
from policies.baselines import RoundRobin
from tests.support.gateway_config import SECRET, tenant
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import healthy, serve_in
from tests.support.metrics import metric_total

KEY = {"authorization": "Bearer sk-a"}


@dataclass
class Worker:
    """Renders on `POST /v1/responses/render`, and holds no stored response (vLLM's 404 for any
    id); remembers every request it got."""

    seen: list[str] = field(default_factory=list)

    async def render(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen.append(f"POST {request.path}")
        return web.json_response({"token_ids": [1, 2, 3]})

    async def stored(self, request: web.Request) -> web.Response:
        self.seen.append(f"GET {request.path}")
        rid = request.match_info["rid"]
        error = {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
                 "param": "response_id", "code": 404}  # fmt: skip
        return web.json_response({"error": error}, status=404)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", healthy)
        app.router.add_post("/v1/responses/render", self.render)
        app.router.add_get("/v1/responses/{rid}", self.stored)
        return app


@pytest.fixture
async def rig() -> AsyncIterator[tuple[InProcessGateway, Worker]]:
    worker = Worker()
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_in(stack, worker.app())
        pool = {"name": "p", "models": ["m"], "workers": [url]}
        config = {"pools": [pool], "tenants": [tenant("a", "sk-a")], "scrape": {"enabled": False}}
        gw = await stack.enter_async_context(gateway_in_process(config, RoundRobin(), secret=SECRET))
        yield gw, worker


async def test_a_get_of_the_render_path_is_a_retrieve_of_a_response_named_render(
    rig: tuple[InProcessGateway, Worker],
) -> None:
    gw, worker = rig
    answer = await gw.client.get("/v1/responses/render", headers=KEY)
    assert answer.status_code == 404, answer.text
    assert answer.json() == {
        "error": {
            "message": "Response with id 'render' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": None,
        }
    }
    assert answer.headers["x-request-id"]
    # An id the gateway never minted for the tenant is no stored response of its: no worker asked.
    assert worker.seen == []
    assert metric_total(gw.state, "kvgate_requests_total", endpoint=RETRIEVE_ENDPOINT, status="404") == 1
    # As every retrieve, it needs the tenant's key.
    assert (await gw.client.get("/v1/responses/render")).status_code == 401


async def test_other_methods_there_are_still_not_allowed_and_a_post_still_renders(
    rig: tuple[InProcessGateway, Worker],
) -> None:
    gw, worker = rig
    for method in ("PUT", "DELETE", "PATCH"):
        answer = await gw.client.request(method, "/v1/responses/render", headers=KEY)
        assert answer.status_code == 405, (method, answer.text)
        assert answer.json()["error"]["code"] == "method_not_allowed"
    # A proxied path that names no stored response: a GET of it is still a method not allowed.
    for path in ("/v1/responses", "/v1/chat/completions/render", "/v1/messages/render"):
        answer = await gw.client.get(path, headers=KEY)
        assert answer.status_code == 405, (path, answer.text)
    assert worker.seen == []
    rendered = await gw.client.post("/v1/responses/render", json={"model": "m", "input": "x"}, headers=KEY)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json() == {"token_ids": [1, 2, 3]}
    assert worker.seen == ["POST /v1/responses/render"]
