"""The access log: one line per request on the API routes, the same fields whatever its fate,
`error` a machine-readable code and `error_detail` the gateway's own words; refusals before
admission included, with what was known of the request by then, never the API key."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.gateway.access_lines import AccessLines, capture_access
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
        ("sk-t", {**RESPONSES_BODY, "stream": "yes"}, 400, "invalid_request", "t", None),
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
