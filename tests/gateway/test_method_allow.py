"""A 405 names the methods its path is served with in `Allow` (RFC 9110 §15.5.6)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.gateway.routes_rig import KEY, Rig, routes_rig


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig() as rig:
        yield rig


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("HEAD", "/v1/chat/completions", "POST"),
        ("OPTIONS", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/embeddings", "POST"),
        ("DELETE", "/v1/responses/render", "GET, HEAD, POST"),
        ("OPTIONS", "/v1/responses/render", "GET, HEAD, POST"),
        ("PUT", "/v1/responses/resp_1", "GET, HEAD"),
        ("GET", "/v1/responses/resp_1/cancel", "POST"),
        ("OPTIONS", "/v1/models", "GET, HEAD"),
        ("PUT", "/v1/models/m", "GET, HEAD"),
        ("POST", "/health", "GET, HEAD"),
        ("OPTIONS", "/health", "GET, HEAD"),
        ("PUT", "/ping", "GET, HEAD, POST"),
        ("PUT", "/v1/messages", "POST"),
    ],
)
async def test_a_405_names_the_allowed_methods(rig: Rig, method: str, path: str, allow: str) -> None:
    resp = await rig.client.request(method, path, headers=KEY)
    assert resp.status_code == 405
    assert resp.headers["allow"] == allow
    if method != "HEAD":
        assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_the_methods_a_path_is_served_with_still_reach_it(rig: Rig) -> None:
    assert (await rig.client.get("/v1/responses/render", headers=KEY)).status_code == 404  # no such id
    assert (await rig.client.head("/health")).status_code == 200
    resp = await rig.client.post("/v1/chat/completions", json={"model": "m", "messages": []}, headers=KEY)
    assert resp.status_code != 405


async def test_with_cors_on_a_preflight_is_still_answered_and_a_plain_options_is_a_405() -> None:
    app = "https://app.example"
    async with routes_rig(cors={"allow_origins": [app]}) as rig:
        preflight = {"origin": app, "access-control-request-method": "POST"}
        assert (await rig.client.options("/v1/chat/completions", headers=preflight)).status_code == 204
        resp = await rig.client.options("/v1/chat/completions", headers={"origin": app})
        assert resp.status_code == 405 and resp.headers["allow"] == "POST"
