"""Every error status, in OpenAI's shape, from a real gateway process."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Stack
from tests.e2e.test_openai_sdk import worker_log
from tests.support.wait import wait_until_sync

CHAT = "/v1/chat/completions"
OK_BODY: dict[str, Any] = {"model": "m-ok", "messages": [{"role": "user", "content": "hi"}]}


def _post(
    stack: Stack,
    content: bytes | None = None,
    json: Any = None,
    key: str | None = "sk-acme",
    path: str = CHAT,
) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(stack.base_url + path, content=content, json=json, headers=headers, timeout=10)


def _assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["x-request-id"]
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("content", "key", "status", "code", "param"),
    [
        (b'{"model": "m-ok", "messages": []}', None, 401, "invalid_api_key", None),
        (b'{"model": "m-ok"}', "sk-wrong", 401, "invalid_api_key", None),
        (b"{not json", "sk-acme", 400, "invalid_request", None),
        (b"[1, 2]", "sk-acme", 400, "invalid_request", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "sk-acme", 400, "invalid_request", "model"),
        (b'{"model": "m-ok", "messages": []}', "sk-acme", 400, "invalid_request", "messages"),
        (b'{"model": "m-ok", "messages": ["x"]}', "sk-acme", 400, "invalid_request", "messages"),
        (
            b'{"model": "m-ok", "messages": [{"role": "user"}], "stream": "maybe"}',
            "sk-acme",
            400,
            None,
            "stream",
        ),
        (
            b'{"model": "m-ok", "messages": [{"role": "user"}], "stream": true, "stream_options": "yes"}',
            "sk-acme",
            400,
            "invalid_request",
            "stream_options",
        ),
        (
            b'{"model": "m-ok", "messages": [{"role": "user"}], "stream": true,'
            b' "stream_options": {"include_usage": "maybe"}}',
            "sk-acme",
            400,
            "invalid_request",
            "stream_options.include_usage",
        ),
        (
            b'{"model": "m-ok", "messages": [{"role": "user"}], "stream_options": {"include_usage": 2}}',
            "sk-acme",
            400,
            "invalid_request",
            "stream_options.include_usage",
        ),
        (
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
            "sk-acme",
            404,
            "model_not_found",
            "model",
        ),
    ],
)
def test_rejections(
    stack: Stack, content: bytes, key: str | None, status: int, code: str | None, param: str | None
) -> None:
    err = _assert_error(_post(stack, content=content, key=key), status, code)
    assert err["param"] == param


def _nested(depth: int) -> str:
    return '{"a": ' * (depth - 1) + "[1]" + "}" * (depth - 1)


@pytest.mark.parametrize("depth", [300, 1023, 1100])
@pytest.mark.parametrize("where", ["extra", "content", "tools"])
def test_deeply_nested_json_is_400(stack: Stack, depth: int, where: str) -> None:
    deep = _nested(depth)
    message = '{"role": "user", "content": "x"}'
    body = {
        "extra": f'{{"model": "m-ok", "messages": [{message}], "metadata": {deep}}}',
        "content": f'{{"model": "m-ok", "messages": [{{"role": "user", "content": [{deep}]}}]}}',
        "tools": f'{{"model": "m-ok", "messages": [{message}], "tools": [{{"type": "function", '
        f'"function": {{"name": "f", "parameters": {deep}}}}}]}}',
    }[where]
    err = _assert_error(_post(stack, content=body.encode()), 400, "invalid_request")
    assert "nested" in err["message"] or "depth" in err["message"]


def test_nesting_within_the_limit_is_served(stack: Stack) -> None:
    message = '{"role": "user", "content": "x"}'
    body = f'{{"model": "m-ok", "messages": [{message}], "metadata": {_nested(200)}}}'
    assert _post(stack, content=body.encode()).status_code == 200


def test_worker_rejection_has_the_gateway_error_shape(stack: Stack) -> None:
    for stream in (False, True):
        body = {"model": "m-reject", "messages": [{"role": "user", "content": "x"}], "stream": stream}
        resp = _post(stack, json=body)
        assert resp.status_code == 400
        assert resp.json() == {
            "error": {
                "message": "max_tokens is too large",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": None,
            }
        }
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-acme", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m-reject", messages=[{"role": "user", "content": "x"}])
    assert info.value.param == "max_tokens" and info.value.code is None


def test_normalizer_rejection_is_400_naming_the_field(stack: Stack) -> None:
    body = {"model": "m-ok", "messages": [{"role": "user", "content": 5}]}
    err = _assert_error(_post(stack, json=body), 400, "invalid_prompt")
    assert err["param"] == "messages[0].content"


def test_completions_without_prompt_is_400(stack: Stack) -> None:
    _assert_error(_post(stack, json={"model": "m-ok"}, path="/v1/completions"), 400, "invalid_request")


def test_body_too_large_is_413(stack: Stack) -> None:
    big = {"model": "m-ok", "messages": [{"role": "user", "content": "x" * 70_000}]}
    _assert_error(_post(stack, json=big), 413, "body_too_large")


def test_unknown_route_and_method(stack: Stack) -> None:
    _assert_error(httpx.get(stack.base_url + "/v1/nothing", timeout=5), 404)
    _assert_error(httpx.get(stack.base_url + CHAT, timeout=5), 405)


def test_a_trailing_slash_is_404_without_a_redirect(stack: Stack) -> None:
    resp = _post(stack, json=OK_BODY, path=CHAT + "/")
    _assert_error(resp, 404, "not_found")
    assert "location" not in resp.headers


def test_sdk_maps_statuses_to_its_exceptions(stack: Stack) -> None:
    base = stack.base_url + "/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="sk-nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base, api_key="sk-acme", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_rpm_quota_is_429_with_retry_after(stack: Stack) -> None:
    statuses = [_post(stack, json=OK_BODY, key="sk-rpm") for _ in range(3)]
    assert [r.status_code for r in statuses[:2]] == [200, 200]
    err = _assert_error(statuses[2], 429, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_error"
    assert 1 <= int(statuses[2].headers["retry-after"]) <= 60
    assert "x-should-retry" not in statuses[2].headers


def test_request_bigger_than_tpm_quota_is_not_retryable(stack: Stack) -> None:
    body = {"model": "m-ok", "messages": [{"role": "user", "content": "y" * 2000}]}
    resp = _post(stack, json=body, key="sk-tpm")
    _assert_error(resp, 429, "insufficient_quota")
    assert resp.headers["x-should-retry"] == "false" and "retry-after" not in resp.headers
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-tpm").chat.completions.create(
            model="m-ok", messages=[{"role": "user", "content": "y" * 2000}]
        )


def test_max_concurrent_is_429(stack: Stack) -> None:
    body = {"model": "m-slow", "messages": [{"role": "user", "content": "x"}], "stream": True}
    started, done = threading.Event(), threading.Event()

    def hold() -> None:
        with httpx.stream(
            "POST", stack.base_url + CHAT, json=body, timeout=10, headers={"authorization": "Bearer sk-one"}
        ) as resp:
            chunks = resp.iter_raw()  # keep the iterator alive: dropping it closes the stream
            next(chunks)
            started.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert started.wait(5)
        resp = _post(stack, json=OK_BODY, key="sk-one")
        _assert_error(resp, 429, "rate_limit_exceeded")
        assert resp.headers["retry-after"] == "1"
    finally:
        done.set()
        t.join()
    # The slot comes back once the gateway sees the client gone.
    wait_until_sync(lambda: _post(stack, json=OK_BODY, key="sk-one").status_code == 200, what="slot back")


def test_no_healthy_worker_is_503(stack: Stack) -> None:
    resp = _post(stack, json={**OK_BODY, "model": "m-none"})
    _assert_error(resp, 503, "no_worker_available")
    assert resp.headers["retry-after"]


def test_worker_timeout_is_504(stack: Stack) -> None:
    # The worker says nothing for 30 s, longer than the client waits (10 s): a 504 can only be the
    # gateway's read timeout (0.5 s), and the worker sees the gateway hang up on it.
    rid = uuid.uuid4().hex
    _assert_error(_post(stack, json={**OK_BODY, "model": "m-hang", "user": rid}), 504, "upstream_timeout")
    wait_until_sync(
        lambda: rid in worker_log(stack.workers["hang"])["cancelled"],
        what="the worker saw the gateway hang up",
    )


def test_probes(stack: Stack) -> None:
    assert httpx.get(stack.base_url + "/healthz", timeout=5).status_code == 200
    assert httpx.get(stack.base_url + "/readyz", timeout=5).json() == {"status": "ready"}


def test_logs_never_contain_prompt_text(stack: Stack) -> None:
    secret_text = "PROMPT-CANARY-7f3a"
    rid = _post(
        stack, json={"model": "m-ok", "messages": [{"role": "user", "content": secret_text}]}
    ).headers["x-request-id"]
    refused = _post(
        stack, json={"model": "m-ok", "messages": [{"role": "user", "content": secret_text}], "stream": "bad"}
    ).headers["x-request-id"]
    # access lines are flushed in batches; a refused request has one too
    wait_until_sync(lambda: rid in stack.gateway.output() and refused in stack.gateway.output())
    log = stack.gateway.output()
    assert f'"request_id":"{rid}"' in log and '"error":"invalid_request"' in log and secret_text not in log
