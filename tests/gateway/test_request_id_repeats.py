"""An `x-request-id` sent twice is read by one rule on every route: the same id twice is that id;
two different ids leave the request without a client id, answered with the gateway's own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.gateway.routes_rig import KEY, Rig, routes_rig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig() as rig:
        yield rig


async def _sent(rig: Rig, route: str, ids: list[str]) -> httpx.Response:
    headers = [*KEY.items(), *(("x-request-id", rid) for rid in ids)]
    if route == "chat":
        return await rig.client.post("/v1/chat/completions", json=CHAT, headers=headers)
    if route == "chat_error":  # refused before any worker: the early error path
        return await rig.client.post("/v1/chat/completions", content=b"{", headers=headers)
    return await rig.client.get(route, headers=headers)


ROUTES = ["chat", "chat_error", "/v1/models", "/v1/responses/resp_x", "/health", "/v1/nothing"]


@pytest.mark.parametrize("route", ROUTES)
async def test_two_different_ids_leave_no_client_id_on_any_route(rig: Rig, route: str) -> None:
    resp = await _sent(rig, route, ["first", "second"])
    assert resp.headers["x-request-id"] not in ("first", "second")
    assert len(resp.headers["x-request-id"]) == 24  # the gateway's own


@pytest.mark.parametrize("route", ROUTES)
async def test_one_id_sent_twice_is_that_id_on_any_route(rig: Rig, route: str) -> None:
    assert (await _sent(rig, route, ["same", "same"])).headers["x-request-id"] == "same"
    assert (await _sent(rig, route, ["one"])).headers["x-request-id"] == "one"
