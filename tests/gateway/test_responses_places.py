"""Stored-response requests are bounded per worker and per process, with each tenant's share
(`transport.StoredPlaces`): one tenant's open retrieves cannot take a worker's connection pool
from the others. A `HEAD` of a stored response is a `GET`'s head."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.config import UpstreamConfig
from gateway.responses_affinity import ResponseAffinity
from gateway.state import GatewayState
from gateway.transport import StoredPlaces
from policies import make_policy
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.wait import wait_until

SECRET = b"stored-places"


def test_a_lone_tenant_gets_a_quarter_of_the_workers_connections() -> None:
    places = StoredPlaces(UpstreamConfig(max_connections_per_worker=256))
    held = [places.take("http://w", "a") for _ in range(64)]
    assert all(p is not None for p in held) and places.per_worker == 64
    assert places.take("http://w", "a") is None  # at the cap, and over its share
    assert places.take("http://other", "a") is not None  # another worker's cap is its own
    places.check_invariants()


def test_another_tenant_borrows_its_share_up_to_half_the_connections() -> None:
    places = StoredPlaces(UpstreamConfig(max_connections_per_worker=8))  # cap 2
    assert places.take("http://w", "a") and places.take("http://w", "a")
    assert places.take("http://w", "a") is None
    # Past the cap, a tenant below its share (the cap split among the tenants holding places,
    # at least 1) gets one, while the worker holds fewer than twice the cap.
    assert places.take("http://w", "b") is not None
    assert places.take("http://w", "b") is None  # at its share: 2 × 1 / 2
    assert places.take("http://w", "c") is not None
    assert places.take("http://w", "d") is None  # twice the cap held
    assert places.held("http://w") == 4
    places.check_invariants()


def test_places_given_back_once_and_idle_workers_forgotten() -> None:
    places = StoredPlaces(UpstreamConfig(max_connections_per_worker=4))
    place = places.take("http://w", "a")
    assert place is not None and places.take("http://w", "a") is None
    place.give_back()
    place.give_back()  # a second time: nothing
    assert places.held("http://w") == 0 and places.process.held == 0
    places.check_invariants()
    assert places.take("http://w", "a") is not None


def test_the_process_cap_bounds_every_worker_together() -> None:
    places = StoredPlaces(UpstreamConfig(max_connections=8, max_connections_per_worker=256))
    assert all(places.take(f"http://w{i}", "a") for i in range(2))
    assert places.take("http://w9", "a") is None  # the process's cap of 2, whatever the worker
    places.check_invariants()


@dataclass
class Holder:
    """Creates responses; holds every retrieve (a streamed one after its head) until the test
    ends, noting the method and path of each and those the gateway closed."""

    asked: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/responses", self._create)
        app.router.add_route("*", "/v1/responses/{rid}", self._hold)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"id": body["request_id"], "object": "response", "status": "completed"})

    async def _hold(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(f"{request.method} {request.path_qs}")
        if request.query.get("stream") == "true":
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"event: response.created\ndata: {}\n\n")
        try:
            await asyncio.Event().wait()
        finally:
            self.closed.append(request.path)
        raise AssertionError("unreachable")


@dataclass
class Stack:
    state: GatewayState
    client: httpx.AsyncClient
    worker: Holder
    url: str


@contextlib.asynccontextmanager
async def stack() -> AsyncIterator[Stack]:
    worker = Holder()
    runner, port = await serve_app(worker.app(), handler_cancellation=True)
    url = f"http://127.0.0.1:{port}"
    config = {
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "workers": [url],
                "health": {"interval_s": 0.05, "timeout_s": 0.5, "failures_to_down": 1},
            }
        ],
        "tenants": [
            {"name": name, "api_key_hashes": [hash_api_key(SECRET, f"sk-{name}")]} for name in ("a", "b")
        ],
        "scrape": {"enabled": False},
        "upstream": {"max_connections_per_worker": 4},  # a place each per worker, two in all
    }
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            yield Stack(gw.state, gw.client, worker, url)
    finally:
        await runner.cleanup()


def _key(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer sk-{tenant}"}


async def _created(s: Stack, tenant: str) -> str:
    resp = await s.client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=_key(tenant))
    assert resp.status_code == 200
    rid: str = resp.json()["id"]
    return rid


async def test_open_retrieves_of_one_tenant_leave_the_others_share() -> None:
    async with stack() as s:
        a, b = await _created(s, "a"), await _created(s, "b")
        held = [
            asyncio.create_task(s.client.get(f"/v1/responses/{rid}", headers=_key(t)))
            for rid, t in [(a, "a")]
        ]
        await wait_until(lambda: len(s.worker.asked) == 1, what="a's retrieve reached the worker")
        refused = await s.client.get(f"/v1/responses/{a}", params={"stream": "true"}, headers=_key("a"))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "gateway_overloaded"
        assert len(s.worker.asked) == 1  # the refused one reached no worker
        # b is below its share: it gets a place past the cap.
        held.append(asyncio.create_task(s.client.get(f"/v1/responses/{b}", headers=_key("b"))))
        await wait_until(lambda: len(s.worker.asked) == 2, what="b's retrieve reached the worker")
        assert s.state.transport.stored.held(s.url) == 2
        for task in held:
            task.cancel()
        for task in held:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await wait_until(lambda: s.state.transport.stored.held(s.url) == 0, what="the places given back")
        s.state.transport.stored.check_invariants()


async def test_a_search_without_a_place_is_a_503_not_a_404() -> None:
    async with stack() as s:
        a = await _created(s, "a")
        # A process that does not know the id (another process's, or restarted): it searches.
        s.state.gate.responses = ResponseAffinity(100, 60.0, 2, ids=s.state.gate.responses.ids)
        hold = s.state.transport.stored.take(s.url, "a")  # the worker's one place for a
        assert hold is not None
        refused = await s.client.get(f"/v1/responses/{a}", headers=_key("a"))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "gateway_overloaded"
        assert s.worker.asked == []
        hold.give_back()


@pytest.mark.parametrize("stream", [False, True])
async def test_head_of_a_stored_response_is_a_gets_head(stream: bool) -> None:
    async with stack() as s:
        a = await _created(s, "a")
        params = {"stream": "true"} if stream else {}
        task = asyncio.create_task(s.client.head(f"/v1/responses/{a}", params=params, headers=_key("a")))
        await wait_until(lambda: s.worker.asked, what="the worker was asked")
        assert s.worker.asked[0].startswith("GET ")
        if not stream:  # the holder holds its answer: the test leaves it
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        resp = await task
        assert resp.status_code == 200 and resp.content == b""
        assert resp.headers["content-type"].startswith("text/event-stream")
        # The stream's head as a GET gets it: no Content-Length (RFC 9110, 8.6).
        assert "content-length" not in resp.headers
        await wait_until(lambda: s.worker.closed, what="the worker's stream closed")
        await wait_until(lambda: s.state.transport.stored.held(s.url) == 0, what="the place given back")
