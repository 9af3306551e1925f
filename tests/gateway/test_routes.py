"""Every vLLM route through the gateway, in-process against scripted workers: pass-through routes
unsalted at the same path, Responses and Messages keyed and salted, each API's errors and
streams, multipart audio, the model list, the gateway's own probes."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from policies import make_policy
from tests.gateway.routes_rig import KEY, SECRET, Rig, config, routes_rig
from tests.gateway.routes_worker import PASS_THROUGH, RoutesWorker, start
from tests.support.inprocess import gateway_in_process


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig() as rig:
        yield rig


@pytest.mark.parametrize("path", PASS_THROUGH[:-1])
async def test_pass_through_routes_reach_the_same_path_unsalted(rig: Rig, path: str) -> None:
    body = {"model": "m", "input": "some text", "cache_salt": "client-chosen", "priority": 2}
    resp = await rig.client.post(path, json=body, headers={**KEY, "x-request-id": "mine"})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == 7
    assert resp.headers["x-request-id"] == "mine"
    got = rig.last()
    assert got.path == path
    # No field of the gateway's: pooling, tokenizer and audio requests have no cache_salt. Nor the
    # client's `priority`: the engine would order other tenants' requests by it.
    assert got.json() == {"model": "m", "input": "some text"}
    assert got.headers["x-request-id"] != "mine"
    # Load-aware: the policy saw the request's size, no keys.
    req = rig.policy.requests[-1]
    assert req.block_keys == () and req.n_prompt_tokens == len(orjson.dumps(body)) // 4
    endpoint = path.rsplit("/", 1)[1]  # embeddings, rerank, score, pooling, ...
    assert rig.metric("kvgate_requests_total", endpoint=endpoint, status="200", tenant="t") == 1


async def test_vllm_request_id_is_passed_through_and_priority_is_not(rig: Rig) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "priority": -3,
        "request_id": "mine",
    }
    assert (await rig.client.post("/v1/chat/completions", json=body, headers=KEY)).status_code == 200
    sent = rig.last()
    # The pool's engines do not schedule by priority: the client's value orders only its
    # tenant's queued requests (tests/gateway/test_engine_priority.py).
    assert "priority" not in sent.json() and sent.json()["request_id"] == "mine"
    # The engine's own id stays the gateway's: vLLM takes X-Request-Id over the body's field.
    assert sent.headers["x-request-id"] != "mine"


async def test_every_route_has_the_same_auth_limits_and_quotas(rig: Rig) -> None:
    for path in ("/v1/embeddings", "/v1/responses", "/tokenize"):
        resp = await rig.client.post(path, json={"model": "m", "input": "x"})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        resp = await rig.client.post(path, json={"model": "m", "input": "x" * 5000}, headers=KEY)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
        resp = await rig.client.post(
            path, json={"model": "m", "input": "x", "kv_transfer_params": {}}, headers=KEY
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"
        resp = await rig.client.post(path, json={"model": "nope", "input": "x"}, headers=KEY)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    # Refused before a served model was known, but once the key was: counted under its tenant.
    assert rig.metric("kvgate_requests_total", endpoint="tokenize", status="401", tenant="") == 1
    assert rig.metric("kvgate_requests_total", endpoint="tokenize", status="413", tenant="t") == 1
    assert rig.metric("kvgate_requests_total", endpoint="tokenize", status="400", tenant="t") == 1
    assert rig.metric("kvgate_requests_total", endpoint="tokenize", status="404", tenant="t") == 1
    one = {"authorization": "Bearer sk-one"}
    assert (
        await rig.client.post("/v1/embeddings", json={"model": "m", "input": "x"}, headers=one)
    ).status_code == 200
    resp = await rig.client.post("/pooling", json={"model": "m", "input": "x"}, headers=one)
    assert resp.status_code == 429 and "retry-after" in resp.headers
    assert rig.metric("kvgate_requests_total", endpoint="pooling", status="429") == 1
    for method in ("GET", "PUT", "DELETE"):
        assert (await rig.client.request(method, "/v1/rerank", headers=KEY)).status_code == 405


async def test_a_request_without_model_goes_to_the_only_model() -> None:
    worker = RoutesWorker("w")
    runner = await start(worker)
    one = config([worker.url])
    two = {**one, "pools": [*one["pools"], {"name": "q", "models": ["m2"], "workers": [worker.url]}]}
    try:
        for raw, expected in ((one, 200), (two, 400)):
            async with gateway_in_process(raw, make_policy("round_robin"), secret=SECRET) as gw:
                resp = await gw.client.post("/tokenize", json={"prompt": "hello"}, headers=KEY)
                assert resp.status_code == expected
                if expected == 400:
                    assert resp.json()["error"]["param"] == "model"
                # Messages always names its model (chat and completions: test_routes_engines).
                resp = await gw.client.post(
                    "/v1/messages", json={"max_tokens": 1, "messages": [{"role": "user"}]}, headers=KEY
                )
                assert resp.status_code == 400
        assert worker.received[0].json() == {"prompt": "hello"}  # forwarded as sent
    finally:
        await runner.cleanup()


async def test_responses_are_keyed_salted_and_their_usage_read(rig: Rig) -> None:
    body = {"model": "m", "instructions": "Answer briefly. " * 20, "input": "hi", "cache_salt": "x"}
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 200 and resp.json()["object"] == "response"
    sent = rig.last().json()
    assert sent["cache_salt"] == rig.state.gate.keyring.tenants["t"].cache_salt
    # Forwarded as sent, with the gateway's own salt and the id it minted for the response.
    assert rig.state.gate.responses.ids.owned_by(sent["request_id"], "t")
    assert resp.json()["id"] == sent["request_id"]
    assert {k: v for k, v in sent.items() if k not in ("cache_salt", "request_id")} == {
        k: v for k, v in body.items() if k != "cache_salt"
    }
    req = rig.policy.requests[-1]
    assert req.block_keys and req.immutable_blocks > 0 and req.namespace == "tenant:t"
    obs = rig.policy.observations[-1]
    assert (obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (40, 32, 2)
    assert rig.metric("kvgate_cached_prompt_tokens_total", tenant="t") == 32


async def test_a_bad_responses_input_is_a_400_naming_the_field(rig: Rig) -> None:
    bad = {"model": "m", "input": [{"type": "message", "role": "robot", "content": "x"}]}
    resp = await rig.client.post("/v1/responses", json=bad, headers=KEY)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input[0].role"
    resp = await rig.client.post("/v1/responses", json={"model": "m"}, headers=KEY)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input"


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in raw.split(b"\n\n"):
        if not event:
            continue
        kind = re.search(rb"^event: (.+)$", event, re.M)
        data = re.search(rb"^data: (.+)$", event, re.M)
        assert data is not None, event
        out.append(
            (
                kind.group(1).decode() if kind else "",
                orjson.loads(data.group(1)) if data.group(1) != b"[DONE]" else {},
            )
        )
    return out


async def test_a_responses_stream_ends_at_its_terminal_event(rig: Rig) -> None:
    resp = await rig.client.post(
        "/v1/responses", json={"model": "m", "input": "hi", "stream": True}, headers=KEY
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp.content)
    assert [k for k, _ in events][-1] == "response.completed" and b"[DONE]" not in resp.content
    assert rig.policy.observations[-1].cached_tokens == 32
    assert "stream_options" not in rig.last().json()  # its usage always rides in response.completed


@pytest.mark.parametrize(
    ("fault", "code"), [("die", "upstream_stream_error"), ("error", "upstream_stream_error")]
)
async def test_a_broken_responses_stream_ends_with_one_error_event(rig: Rig, fault: str, code: str) -> None:
    for w in rig.workers:
        w.fault = fault
    resp = await rig.client.post(
        "/v1/responses", json={"model": "m", "input": "hi", "stream": True}, headers=KEY
    )
    events = _events(resp.content)
    kind, data = events[-1]
    assert kind == "error" and data["type"] == "error" and data["code"] == code
    assert [k for k, _ in events].count("error") == 1 and b"[DONE]" not in resp.content
    assert data["sequence_number"] == len(events) - 1
    if fault == "error":
        assert data["message"] == "engine failed"


async def test_messages_take_the_key_in_x_api_key_and_read_anthropic_usage(rig: Rig) -> None:
    system = [{"type": "text", "text": "S" * 300, "cache_control": {"type": "ephemeral"}}]
    body = {"model": "m", "max_tokens": 8, "system": system, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": "sk-t", "anthropic-version": "2023-06-01"}
    resp = await rig.client.post("/v1/messages", json=body, headers=headers)
    assert resp.status_code == 200 and resp.json()["usage"]["cache_read_input_tokens"] == 32
    assert rig.last().json()["cache_salt"] == rig.state.gate.keyring.tenants["t"].cache_salt
    obs = rig.policy.observations[-1]
    assert (obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (36, 32, 2)
    assert rig.policy.requests[-1].immutable_blocks > 0
    # The key is read from x-api-key only on the Anthropic routes.
    resp = await rig.client.post("/v1/embeddings", json={"model": "m", "input": "x"}, headers=headers)
    assert resp.status_code == 401


def _anthropic_error(resp: httpx.Response, status: int, type_: str) -> str:
    assert resp.status_code == status
    body = resp.json()
    assert (
        body["type"] == "error"
        and body["error"]["type"] == type_
        and set(body["error"]) == {"type", "message"}
    )
    message: str = body["error"]["message"]
    return message


async def test_errors_on_the_messages_routes_have_anthropics_shape(rig: Rig) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    _anthropic_error(await rig.client.post("/v1/messages", json=body), 401, "authentication_error")
    _anthropic_error(
        await rig.client.post("/v1/messages", json={**body, "model": "x"}, headers=KEY),
        404,
        "not_found_error",
    )
    bad = {**body, "messages": [{"role": "tool", "content": "x"}]}
    _anthropic_error(
        await rig.client.post("/v1/messages", json=bad, headers=KEY), 400, "invalid_request_error"
    )
    big = {**body, "system": "x" * 5000}
    _anthropic_error(await rig.client.post("/v1/messages", json=big, headers=KEY), 413, "request_too_large")
    for w in rig.workers:
        w.status, w.error_body = (
            400,
            {"type": "error", "error": {"type": "invalid_request_error", "message": "bad temp"}},
        )
    message = _anthropic_error(
        await rig.client.post("/v1/messages", json=body, headers=KEY), 400, "invalid_request_error"
    )
    assert message == "bad temp"
    resp = await rig.client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "sk-t"})
    _anthropic_error(resp, 400, "invalid_request_error")
    for w in rig.state.registry.pools["p"].workers.values():
        w.healthy = False
    resp = await rig.client.post("/v1/messages", json=body, headers=KEY)
    _anthropic_error(resp, 503, "overloaded_error")
    assert resp.headers["retry-after"] == "1"


async def test_unknown_routes_and_methods_under_messages_answer_in_anthropics_shape(rig: Rig) -> None:
    _anthropic_error(await rig.client.get("/v1/messages", headers=KEY), 405, "invalid_request_error")
    resp = await rig.client.post("/v1/messages/batches", json={}, headers=KEY)
    assert _anthropic_error(resp, 404, "not_found_error") == "unknown route POST /v1/messages/batches"
    assert resp.headers["x-request-id"]
    # Elsewhere, and on a path that only begins like it, the OpenAI shape.
    for path in ("/v1/nothing", "/v1/messagesx"):
        resp = await rig.client.post(path, json={}, headers=KEY)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


async def test_a_405_quotes_a_long_path_shortened(rig: Rig) -> None:
    resp = await rig.client.delete("/v1/responses/" + "a" * 20_000, headers=KEY)
    assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"
    message = resp.json()["error"]["message"]
    assert message.startswith("method DELETE not allowed on /v1/responses/aaa") and message.endswith("...")
    assert len(resp.content) < 1_000


@pytest.mark.parametrize("fault", [None, "done_after_stop", "die", "error"])
async def test_a_messages_stream_relays_anthropic_events(rig: Rig, fault: str | None) -> None:
    for w in rig.workers:
        w.fault = fault
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    resp = await rig.client.post("/v1/messages", json=body, headers=KEY)
    events = _events(resp.content)
    kinds = [k for k, _ in events]
    assert b"[DONE]" not in resp.content
    if fault in (None, "done_after_stop"):
        assert kinds[-1] == "message_stop" and "error" not in kinds
        obs = rig.policy.observations[-1]
        assert (obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (36, 32, 2)
    else:
        assert kinds[-1] == "error" and kinds.count("error") == 1
        error = events[-1][1]["error"]
        assert error["type"] == ("overloaded_error" if fault == "error" else "api_error")


async def test_audio_is_forwarded_as_the_clients_multipart_form(rig: Rig) -> None:
    files = {"file": ("a.wav", b"RIFF" + bytes(range(200)), "audio/wav")}
    resp = await rig.client.post(
        "/v1/audio/transcriptions", data={"model": "m", "language": "en"}, files=files, headers=KEY
    )
    assert resp.status_code == 200 and resp.json()["text"] == "a transcript"
    got = rig.last()
    assert (
        got.path == "/v1/audio/transcriptions"
        and b'name="language"' in got.body
        and bytes(range(200)) in got.body
    )
    boundary = re.search(r'boundary="?([^";]+)', got.headers["content-type"])
    assert boundary is not None and got.body.startswith(b"--" + boundary.group(1).encode())
    for w in rig.workers:
        w.text_answer = True
    resp = await rig.client.post("/v1/audio/translations", data={"model": "m"}, files=files, headers=KEY)
    assert resp.status_code == 200 and resp.text == "a plain transcript"
    assert rig.policy.requests[-1].n_prompt_tokens == 0
    resp = await rig.client.post("/v1/audio/transcriptions", json={"model": "m"}, headers=KEY)
    assert resp.status_code == 400 and "multipart/form-data" in resp.json()["error"]["message"]
    broken = {"content-type": "multipart/form-data; boundary=zz", **KEY}
    resp = await rig.client.post("/v1/audio/transcriptions", content=b"--zz\r\nno end", headers=broken)
    assert resp.status_code == 400


async def test_models_lists_only_models_with_a_routable_worker(rig: Rig) -> None:
    resp = await rig.client.get("/v1/models", headers=KEY)
    assert [m["id"] for m in resp.json()["data"]] == ["m"]
    card = (await rig.client.get("/v1/models/m", headers=KEY)).json()
    assert card["id"] == "m" and card["object"] == "model"
    assert (await rig.client.get("/v1/models/org/model", headers=KEY)).status_code == 404
    assert (await rig.client.get("/v1/models/m")).status_code == 401
    for w in rig.state.registry.pools["p"].workers.values():
        w.healthy = False
    assert (await rig.client.get("/v1/models", headers=KEY)).json()["data"] == []
    resp = await rig.client.get("/v1/models/m", headers=KEY)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


async def test_health_and_version_are_the_gateways_own(rig: Rig) -> None:
    for w in rig.state.registry.pools["p"].workers.values():
        w.healthy = False
    resp = await rig.client.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    version = (await rig.client.get("/version")).json()["version"]
    assert isinstance(version, str) and version
    assert all(not w.received for w in rig.workers)
