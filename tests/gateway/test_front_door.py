"""What a client controls before admission, in process against scripted workers (`routes_rig`):
the credentials it sends, and what a request the gateway refuses still costs its tenant."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator

import orjson
import pytest

from tests.gateway.routes_rig import Rig, routes_rig

ONE = {"authorization": "Bearer sk-one"}  # tenant "one": rpm 1
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig() as rig:
        yield rig


async def test_a_request_refused_after_its_body_was_read_counts_against_rpm(rig: Rig) -> None:
    # Bodies that fail after being read and parsed cost the gateway that work: charged only on
    # admission, a tenant could send them without limit whatever its rpm.
    bad = await rig.client.post(
        "/v1/chat/completions", json={**CHAT, "messages": [{"content": 5}]}, headers=ONE
    )
    assert bad.status_code == 400
    resp = await rig.client.post("/v1/chat/completions", json=CHAT, headers=ONE)
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert not any(w.received for w in rig.workers)


@pytest.mark.parametrize(
    ("path", "name"), [("/v1/chat/completions", "authorization"), ("/v1/messages", "x-api-key")]
)
async def test_a_request_that_sends_its_key_twice_is_refused(rig: Rig, path: str, name: str) -> None:
    # The proxied routes read the last Authorization field and Starlette's routes the first: a
    # head with two keys named a different tenant depending on the route.
    keys = ["Bearer sk-t", "Bearer sk-other"] if name == "authorization" else ["sk-t", "sk-other"]
    body = {**CHAT, "max_tokens": 4}
    resp = await rig.client.post(path, json=body, headers=[(name, key) for key in keys])
    assert resp.status_code == 400
    assert "more than one" in resp.text
    assert not any(w.received for w in rig.workers)
    one = await rig.client.post(path, json=body, headers=[(name, keys[1])])
    assert one.status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "alone"),
    [
        ("GET", "/v1/models", 200),
        ("GET", "/v1/models/m", 200),
        ("GET", "/v1/responses/resp_unknown", 404),
        ("POST", "/v1/responses/resp_unknown/cancel", 404),
    ],
)
async def test_the_starlette_routes_refuse_a_key_sent_twice_as_the_proxied_ones_do(
    rig: Rig, method: str, path: str, alone: int
) -> None:
    # Starlette's `request.headers.get` reads the first field: the second key was never looked at.
    twice = [("authorization", "Bearer sk-t"), ("authorization", "Bearer sk-other")]
    resp = await rig.client.request(method, path, headers=twice)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key" and error["message"].startswith("send one API key")
    assert not any(w.received for w in rig.workers)
    assert (await rig.client.request(method, path, headers=twice[1:])).status_code == alone
    missing = await rig.client.request(method, path)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


async def test_a_messages_request_with_two_different_keys_in_two_headers_is_refused(rig: Rig) -> None:
    body = {**CHAT, "max_tokens": 4}
    two = [("authorization", "Bearer sk-t"), ("x-api-key", "sk-other")]
    resp = await rig.client.post("/v1/messages", json=body, headers=two)
    assert resp.status_code == 400 and "more than one" in resp.text
    assert not any(w.received for w in rig.workers)
    same = [("authorization", "bearer sk-other"), ("x-api-key", "sk-other")]  # one key, sent twice
    assert (await rig.client.post("/v1/messages", json=body, headers=same)).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models/" + "m" * 30_000), ("GET", "/v1/responses/" + "r" * 30_000), ("GET", "/x" * 15_000)],
)
async def test_a_long_path_is_quoted_back_only_in_part(rig: Rig, method: str, path: str) -> None:
    resp = await rig.client.request(method, path, headers={"authorization": "Bearer sk-t"})
    assert resp.status_code == 404 and len(resp.content) < 1_000


async def test_an_unknown_model_is_quoted_back_only_in_part(rig: Rig) -> None:
    resp = await rig.client.post(
        "/v1/chat/completions", json={**CHAT, "model": "x" * 3_000}, headers={"authorization": "Bearer sk-t"}
    )
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert len(resp.content) < 1_000


async def test_a_compressed_body_is_refused_as_such(rig: Rig) -> None:
    # Neither the gateway nor the engines decompress request bodies: say so, not the JSON parser's
    # complaint about the bytes.
    raw = gzip.compress(orjson.dumps({**CHAT, "max_tokens": 4}))
    headers = {"authorization": "Bearer sk-t", "content-encoding": "gzip", "content-type": "application/json"}
    resp = await rig.client.post("/v1/chat/completions", content=raw, headers=headers)
    assert resp.status_code == 415 and resp.json()["error"]["code"] == "unsupported_content_encoding"
    assert not any(w.received for w in rig.workers)
    plain = await rig.client.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 4},
        headers={**headers, "content-encoding": "identity"},
    )
    assert plain.status_code == 200
