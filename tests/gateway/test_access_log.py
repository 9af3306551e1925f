"""The access log: one line per request on the API routes, the same fields whatever its fate,
`error` a machine-readable code and `error_detail` the gateway's own words; refusals before
admission included, with what was known of the request by then, never the API key."""

from __future__ import annotations

from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.access_lines import AccessLines, capture_access
from tests.gateway.request_rig import request_rig
from tests.gateway.routes_rig import Rig, routes_rig

FIELDS = {
    "ts",
    "level",
    "logger",
    "msg",
    "request_id",
    "client_request_id",
    "tenant",
    "model",
    "endpoint",
    "stream",
    "status",
    "worker",
    "reason",
    "retries",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "ttft_ms",
    "duration_ms",
    "error",
    "error_detail",
    "drift_field",
    "queue_ms",
    "hold_ms",
}
RESPONSES_BODY = {"model": "m", "input": "hello"}


@pytest.fixture
async def rig() -> AsyncIterator[tuple[Rig, AccessLines]]:
    async with routes_rig() as built:
        yield built, capture_access(built.state)


async def _post(rig: Rig, path: str, body: object, key: str = "sk-t", rid: str = "") -> str:
    headers = {"authorization": f"Bearer {key}", "x-request-id": rid}
    resp = await rig.client.post(path, json=body, headers=headers)
    return resp.headers["x-request-id"]


async def test_a_served_request_has_every_field(rig: tuple[Rig, AccessLines]) -> None:
    r, lines = rig
    line = lines.of(
        await _post(r, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    )
    assert set(line) == FIELDS
    assert (line["status"], line["error"], line["error_detail"], line["tenant"]) == (200, None, None, "t")


async def test_whole_answers_and_streams_log_an_error_code_and_words(rig: tuple[Rig, AccessLines]) -> None:
    r, lines = rig
    for worker in r.workers:
        worker.status = 500
    line = lines.of(await _post(r, "/v1/responses", RESPONSES_BODY, rid="whole"))
    assert (line["status"], line["error"]) == (502, "bad_gateway")
    assert line["error_detail"] == "worker answered 500"
    for worker in r.workers:
        worker.status, worker.fault = 200, "die"
    line = lines.of(await _post(r, "/v1/responses", {**RESPONSES_BODY, "stream": True}, rid="streamed"))
    assert (line["status"], line["error"], line["stream"]) == (502, "upstream_stream_error", True)
    assert line["error_detail"].startswith("worker stream")
    assert set(line) == FIELDS


@pytest.mark.parametrize(
    ("key", "body", "status", "error", "tenant", "model"),
    [
        ("sk-wrong", RESPONSES_BODY, 401, "invalid_api_key", None, None),
        ("sk-t", {**RESPONSES_BODY, "stream": "maybe"}, 400, "invalid_request", "t", None),
        # The name of a model the gateway does not serve is the client's: not logged.
        ("sk-t", {**RESPONSES_BODY, "model": "nope"}, 404, "model_not_found", "t", None),
        ("sk-t", {**RESPONSES_BODY, "input": "x" * 5000}, 413, "body_too_large", "t", None),
    ],
)
async def test_a_refused_request_has_its_access_line(
    rig: tuple[Rig, AccessLines],
    key: str,
    body: object,
    status: int,
    error: str,
    tenant: str | None,
    model: str | None,
) -> None:
    r, lines = rig
    line = lines.of(await _post(r, "/v1/responses", body, key=key, rid="refused"))
    assert set(line) == FIELDS
    assert (line["status"], line["error"], line["tenant"], line["model"]) == (status, error, tenant, model)
    assert (line["endpoint"], line["client_request_id"], line["worker"]) == ("responses", "refused", None)
    assert line["error_detail"] is None and isinstance(line["duration_ms"], float)
    assert key not in str(lines.records) and not any(w.received for w in r.workers)


async def test_a_tenant_over_its_rate_has_its_access_line(rig: tuple[Rig, AccessLines]) -> None:
    r, lines = rig
    first = lines.of(await _post(r, "/v1/responses", RESPONSES_BODY, key="sk-one", rid="first"))
    assert first["status"] == 200
    line = lines.of(await _post(r, "/v1/responses", RESPONSES_BODY, key="sk-one", rid="second"))
    assert (line["status"], line["tenant"], line["endpoint"]) == (429, "one", "responses")
    assert (line["error"], line["model"]) == ("rate_limit_exceeded", None)  # refused from its headers


async def test_what_admission_knew_is_logged(rig: tuple[Rig, AccessLines]) -> None:
    """A refusal after the body was read names the served model and the route the body chose."""
    r, lines = rig
    line = lines.of(await _post(r, "/v1/responses", {**RESPONSES_BODY, "request_id": "no spaces"}, rid="a"))
    assert (line["status"], line["error"], line["model"], line["stream"]) == (
        400,
        "invalid_request",
        "m",
        False,
    )
    chat = {"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True}
    line = lines.of(await _post(r, "/invocations", chat, rid="b"))
    assert (line["status"], line["endpoint"], line["stream"], line["model"]) == (404, "chat", True, None)


async def test_a_client_gone_while_sending_its_body_has_its_access_line(tiny_model: Path) -> None:
    async with request_rig(tiny_model) as rig:
        lines = capture_access(rig.state)
        parts: list[dict[str, Any]] = [
            {"type": "http.request", "body": b'{"model": "m", "messa', "more_body": True},
            {"type": "http.disconnect"},
        ]
        sent: list[MutableMapping[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return parts.pop(0)

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(b"authorization", b"Bearer sk-strict"), (b"x-request-id", b"gone")],
            "query_string": b"",
        }
        await rig.app(scope, receive, send)
        assert sent == []  # nobody to answer
        line = lines.of("gone")
        assert set(line) == FIELDS
        assert (line["status"], line["error"], line["tenant"], line["endpoint"]) == (
            499,
            "client_disconnected",
            "strict",
            "chat",
        )


async def test_stored_response_requests_have_their_access_lines(rig: tuple[Rig, AccessLines]) -> None:
    r, lines = rig
    created = await r.client.post(
        "/v1/responses", json=RESPONSES_BODY, headers={"authorization": "Bearer sk-t"}
    )
    rid = created.json()["id"]
    holder = next(w.url for w in r.workers if w.received)
    headers = {"authorization": "Bearer sk-t", "x-request-id": "get"}
    assert (await r.client.get(f"/v1/responses/{rid}", headers=headers)).status_code == 200
    line = lines.of("get")
    assert set(line) == FIELDS
    assert (line["endpoint"], line["status"], line["tenant"], line["worker"], line["error"]) == (
        "responses.retrieve",
        200,
        "t",
        holder,
        None,
    )
    # The id the worker got is the line's request_id, as on the proxied routes.
    assert r.last().headers["x-request-id"] == line["request_id"]
    await r.client.get("/v1/responses/resp_unknown", headers={**headers, "x-request-id": "unknown"})
    line = lines.of("unknown")
    assert (line["status"], line["error"], line["worker"]) == (404, "invalid_request_error", None)
    await r.client.post(
        f"/v1/responses/{rid}/cancel", headers={"authorization": "Bearer sk-wrong", "x-request-id": "nokey"}
    )
    line = lines.of("nokey")
    assert (line["endpoint"], line["status"], line["error"], line["tenant"]) == (
        "responses.cancel",
        401,
        "invalid_api_key",
        None,
    )


async def test_a_large_body_refused_by_the_normalizer_names_its_model() -> None:
    """A body over the inline size is keyed in the keying process; the normalizer's refusal is
    logged as the same refusal of a small body is, with the served model."""
    normalizer = {"mode": "approximate", "max_input_chars": 1000}
    async with routes_rig(pool={"normalizer": normalizer}, limits={"max_body_bytes": 1 << 20}) as r:
        lines = capture_access(r.state)
        for size in (2_000, 300_000):
            body = {"model": "m", "messages": [{"role": "user", "content": "x" * size}]}
            line = lines.of(await _post(r, "/v1/chat/completions", body, rid=f"big-{size}"))
            assert (line["status"], line["error"], line["model"], line["endpoint"]) == (
                400,
                "input_too_large",
                "m",
                "chat",
            )
        assert not any(w.received for w in r.workers)
