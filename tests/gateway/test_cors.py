"""The CORS layer on its own (`gateway/cors.py`), around a route that records what reaches it."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.config.cors import CorsConfig
from gateway.cors import Cors

APP = b"https://app.example"


async def _call(cors: Cors, method: str, path: str, headers: dict[str, str]) -> tuple[dict[str, Any], bool]:
    """The answer's head (headers as a dict of lists) and whether the route was reached."""
    sent: list[dict[str, Any]] = []
    reached = False

    async def route(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"r1")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    await cors(scope, receive, send, route)
    head: dict[str, Any] = {"status": sent[0]["status"], "body": sent[1].get("body", b"")}
    for name, value in sent[0]["headers"]:
        head.setdefault(name.decode(), []).append(value.decode())
    return head, reached


def _cors(**config: Any) -> Cors:
    return Cors(CorsConfig(**config), lambda scope: scope["path"] != "/unknown")


def _preflight(method: str = "POST", headers: str = "") -> dict[str, str]:
    asked = {"origin": APP.decode(), "access-control-request-method": method}
    return {**asked, "access-control-request-headers": headers} if headers else asked


async def test_a_listed_origin_is_named_back_with_vary() -> None:
    head, reached = await _call(
        _cors(allow_origins=[APP.decode()]), "POST", "/v1/x", {"origin": APP.decode()}
    )
    assert reached and head["access-control-allow-origin"] == [APP.decode()]
    assert head["vary"] == ["origin"] and head["x-request-id"] == ["r1"]
    assert "access-control-allow-credentials" not in head


async def test_any_origin_is_a_star_without_vary() -> None:
    head, _ = await _call(_cors(allow_origins=["*"]), "GET", "/v1/x", {"origin": "https://a.example"})
    assert head["access-control-allow-origin"] == ["*"] and "vary" not in head


async def test_restricted_methods_and_headers_refuse_what_they_do_not_list() -> None:
    cors = _cors(allow_origins=[APP.decode()], allow_methods=["POST"], allow_headers=["authorization"])
    ok, reached = await _call(cors, "OPTIONS", "/v1/x", _preflight("POST", "Authorization, Content-Type"))
    assert not reached and ok["status"] == 204
    assert ok["access-control-allow-methods"] == ["POST"]
    assert ok["access-control-allow-headers"] == ["authorization, content-type"]  # content-type: safelisted
    for asked in (_preflight("DELETE"), _preflight("POST", "x-other")):
        refused, reached = await _call(cors, "OPTIONS", "/v1/x", asked)
        assert not reached and refused["status"] == 403
        assert orjson.loads(refused["body"])["error"]["code"] == "cors_not_allowed"
        assert "access-control-allow-origin" not in refused


async def test_what_is_not_a_preflight_of_a_served_route_reaches_the_route() -> None:
    cors = _cors(allow_origins=[APP.decode()])
    for path, headers in (("/unknown", _preflight()), ("/v1/x", {"origin": APP.decode()})):
        head, reached = await _call(cors, "OPTIONS", path, headers)
        assert reached and head["access-control-allow-origin"] == [APP.decode()]


async def test_other_origins_and_no_origin_get_no_cors_headers_and_vary_on_origin() -> None:
    """With origins listed, the answer depends on the request's Origin whether it is allowed or
    absent, so caches are told to key on it; with any origin it does not."""
    cors = _cors(allow_origins=[APP.decode()])
    for headers in ({"origin": "https://evil.example"}, {}):
        head, reached = await _call(cors, "POST", "/v1/x", headers)
        assert reached and not [name for name in head if name.startswith("access-control-")]
        assert head["vary"] == ["origin"] and head["x-request-id"] == ["r1"]
    head, _ = await _call(_cors(allow_origins=["*"]), "POST", "/v1/x", {})
    assert "vary" not in head and "access-control-allow-origin" not in head


async def test_a_refused_preflight_on_the_messages_api_is_in_anthropics_envelope() -> None:
    cors = _cors(allow_origins=[APP.decode()])
    evil = {"origin": "https://evil.example", "access-control-request-method": "POST"}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        refused, reached = await _call(cors, "OPTIONS", path, evil)
        assert not reached and refused["status"] == 403
        body = orjson.loads(refused["body"])
        assert body["type"] == "error" and body["error"]["type"] == "permission_error"
        assert "CORS preflight refused" in body["error"]["message"]
    refused, _ = await _call(cors, "OPTIONS", "/v1/messagesx", evil)  # not the Messages API
    assert orjson.loads(refused["body"])["error"]["code"] == "cors_not_allowed"
