"""Fault injection on real processes: down workers, 500s, deaths mid-stream, errors inside a
stream, client disconnects."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Stack
from tests.e2e.harness import (
    Proc,
    free_port,
    start_fake_workers,
    start_gateway,
    tenant,
    write_gateway_config,
)
from tests.e2e.test_openai_sdk import worker_log
from tests.support.wait import wait_until_sync


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-acme", max_retries=0, timeout=10)


def test_down_worker_is_routed_around(stack: Stack) -> None:
    for _ in range(4):
        reply = _client(stack).chat.completions.create(
            model="m-down", messages=[{"role": "user", "content": "x"}]
        )
        assert "hello from the fake worker" in (reply.choices[0].message.content or "")


@pytest.mark.parametrize("stream", [False, True])
def test_500_before_first_byte_is_retried_on_another_worker(stack: Stack, stream: bool) -> None:
    stack.wait_routable("retry", 2)  # a retry needs a second routable worker
    rid = uuid.uuid4().hex
    result = _client(stack).chat.completions.create(
        model="m-retry",
        messages=[{"role": "user", "content": "x"}],
        stream=stream,
        user=rid,
    )
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in result if c.choices)  # type: ignore[union-attr]
    else:
        text = result.choices[0].message.content or ""  # type: ignore[union-attr]
    assert "hello from the fake worker" in text
    # The first worker answered 500; the same request then went to the other worker.
    first = [
        r["request_id"]
        for r in worker_log(stack.workers["once500a"])["requests"]
        if r["body"].get("user") == rid
    ]
    second = [
        r["request_id"]
        for r in worker_log(stack.workers["once500b"])["requests"]
        if r["body"].get("user") == rid
    ]
    assert len(first) == 1 and first == second  # one request (one internal id), two workers


def test_all_attempts_failing_is_a_502(stack: Stack) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        _client(stack).chat.completions.create(model="m-500", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 502


def test_worker_dying_mid_stream_gives_one_error_event_and_the_sdk_raises(stack: Stack) -> None:
    with pytest.raises(openai.APIError):
        for _ in _client(stack).chat.completions.create(
            model="m-die", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            pass
    events = _stream_events(stack.base_url, "m-die")
    errors = [e for e in events if e.startswith(b'data: {"error"')]
    assert len(errors) == 1 and events[-1] == b"data: [DONE]" and events[-2] == errors[0]


def test_client_disconnect_cancels_the_upstream_request(stack: Stack) -> None:
    rid = uuid.uuid4().hex
    body = {"model": "m-slow", "messages": [{"role": "user", "content": "x"}], "stream": True, "user": rid}
    with httpx.stream(
        "POST",
        stack.base_url + "/v1/chat/completions",
        json=body,
        timeout=10,
        headers={"authorization": "Bearer sk-acme", "x-request-id": rid},
    ) as resp:
        first = next(resp.iter_raw())
        assert first.startswith(b"data: ")
    # The slow worker would stream for 10 s; it must see the cancel within a moment.
    _expect_cancelled(stack, rid, "the worker never saw the client's disconnect")


def test_client_disconnect_cancels_a_non_streamed_request(stack: Stack) -> None:
    rid = uuid.uuid4().hex
    body = {"model": "m-slow", "messages": [{"role": "user", "content": "x"}], "user": rid}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            stack.base_url + "/v1/chat/completions",
            json=body,
            timeout=httpx.Timeout(10, read=0.6),
            headers={"authorization": "Bearer sk-acme", "x-request-id": rid},
        )
    _expect_cancelled(stack, rid, "the worker kept generating for a client that left")


def _expect_cancelled(stack: Stack, rid: str, failure: str) -> None:
    """The slow worker logs request `rid` as cancelled (it would otherwise generate for 10 s)."""
    wait_until_sync(lambda: rid in worker_log(stack.workers["slow"])["cancelled"], timeout_s=5, what=failure)


def test_worker_killed_after_being_healthy_is_retried_then_avoided(tmp_path: Path) -> None:
    victim_port, ok_port, gw_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    victim = start_fake_workers({victim_port: "ok"})
    ok = start_fake_workers({ok_port: "ok"})
    gateway = None
    try:
        urls = [f"http://127.0.0.1:{victim_port}", f"http://127.0.0.1:{ok_port}"]
        # Slow health checks: only the data path can notice the death.
        pool = {
            "name": "p",
            "models": ["m"],
            "workers": urls,
            "health": {"interval_s": 60},
            "breaker": {"failure_threshold": 1, "cooldown_s": 60},
        }
        config = write_gateway_config(tmp_path / "gw.yaml", [pool], [tenant("t", "sk-t")])
        gateway = start_gateway(config, gw_port, metrics_port)
        victim.stop(signal.SIGKILL)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="sk-t", max_retries=0, timeout=10
        )
        for _ in range(3):
            reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            assert f"ok-{ok_port}" in (reply.choices[0].message.content or "")
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        # One connect failure, one retry; the open breaker keeps later requests away from the corpse.
        assert 'kvgate_upstream_retries_total{pool="p",reason="connect_error"} 1.0' in metrics
    finally:
        if gateway is not None:
            gateway.stop()
        ok.stop()
        victim.stop()


def test_dns_discovery_finds_workers_and_routes_around_dead_addresses(tmp_path: Path) -> None:
    port, gw_port, metrics_port = free_port(), free_port(), free_port()
    workers = start_fake_workers({port: "ok"})  # listens on 127.0.0.1 only
    gateway = None
    try:
        # "localhost" may also resolve to ::1, where nothing listens: that address must stay unhealthy.
        pool = {
            "name": "p",
            "models": ["m"],
            "dns": {"name": "localhost", "port": port, "refresh_s": 1},
        }
        config = write_gateway_config(tmp_path / "gw.yaml", [pool], [tenant("t", "sk-t")])
        gateway = start_gateway(config, gw_port, metrics_port)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="sk-t", max_retries=0, timeout=10
        )
        for _ in range(3):
            reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            assert f"ok-{port}" in (reply.choices[0].message.content or "")
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert f'kvgate_worker_healthy{{pool="p",worker="http://127.0.0.1:{port}"}} 1.0' in metrics
    finally:
        if gateway is not None:
            gateway.stop()
        workers.stop()


@dataclass
class ErrorStack:
    """A gateway in front of workers that report an error inside a started stream."""

    base_url: str
    workers: dict[str, str]
    gateway: Proc


@pytest.fixture(scope="module")
def error_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ErrorStack]:
    ports = {"streamerr400": free_port(), "streamerr500": free_port()}
    fake = start_fake_workers({port: mode for mode, port in ports.items()})
    gateway = None
    try:
        urls = {mode: f"http://127.0.0.1:{port}" for mode, port in ports.items()}
        pools = [
            # A low breaker threshold: errors the worker blames on the request must not trip it.
            {
                "name": "e400",
                "models": ["m-err400"],
                "workers": [urls["streamerr400"]],
                "breaker": {"failure_threshold": 2},
            },
            # A worker's own error event counts against no worker; a high threshold keeps this lone
            # worker routable whatever the rule.
            {
                "name": "e500",
                "models": ["m-err500"],
                "workers": [urls["streamerr500"]],
                "breaker": {"failure_threshold": 100},
            },
        ]
        folder = tmp_path_factory.mktemp("gw-stream-errors")
        config = write_gateway_config(folder / "gw.yaml", pools, [tenant("acme", "sk-acme")])
        port = free_port()
        gateway = start_gateway(config, port)
        yield ErrorStack(f"http://127.0.0.1:{port}", urls, gateway)
    finally:
        if gateway is not None:
            gateway.stop()
        fake.stop()


# model: worker mode, error type the client sees, param, worker's status, status in the access log
# (the worker blamed the request: its 4xx, not counted against the worker; else 502).
STREAM_ERRORS = {
    "m-err400": ("streamerr400", "invalid_request_error", "messages", 400, 400),
    "m-err500": ("streamerr500", "server_error", None, 500, 502),
}


def _log_lines(proc: Proc, needle: str, count: int) -> list[dict[str, Any]]:
    def logged() -> list[dict[str, Any]] | None:
        lines = [json.loads(line) for line in proc.output().splitlines() if needle in line]
        return lines if len(lines) >= count else None

    return wait_until_sync(logged, what=f"{count} log lines with {needle}") or []


@pytest.mark.parametrize("model", sorted(STREAM_ERRORS))
def test_worker_error_inside_a_stream_reaches_the_sdk_in_the_gateway_shape(
    error_stack: ErrorStack, model: str
) -> None:
    mode, type_, param, worker_status, status = STREAM_ERRORS[model]
    client = openai.OpenAI(
        base_url=error_stack.base_url + "/v1", api_key="sk-acme", max_retries=0, timeout=10
    )
    for _ in range(3):  # more than the e400 pool's breaker threshold
        secret, rid = f"prompt-{uuid.uuid4().hex}", uuid.uuid4().hex
        text = ""
        with pytest.raises(openai.APIError) as info:
            for chunk in client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": secret}],
                stream=True,
                user=rid,
                extra_headers={"x-request-id": rid},
            ):
                text += chunk.choices[0].delta.content or ""
        # The worker keeps streaming for 10 s after its error; the client is not kept waiting:
        # its stream has ended while the worker's has not.
        assert f"finished:{rid}" not in worker_log(error_stack.workers[mode])["cancelled"]
        assert text == "partial " and "after" not in text
        assert secret in info.value.message
        assert info.value.body == {
            "message": info.value.message,
            "type": type_,
            "param": param,
            "code": "upstream_stream_error",
        }
        # The gateway closed the upstream connection, so the worker stopped generating.
        wait_until_sync(
            lambda rid=rid: rid in worker_log(error_stack.workers[mode])["cancelled"],
            what="the worker saw the gateway hang up",
        )
        (access,) = _log_lines(error_stack.gateway, f'"client_request_id":"{rid}"', 1)
        assert access["status"] == status and access["error"] == "upstream_stream_error"
        (warning,) = _log_lines(error_stack.gateway, access["request_id"], 2)[:1]
        assert warning["error_type"] == type_ and warning["worker_status"] == worker_status
        assert secret not in error_stack.gateway.output()  # neither the prompt nor the message


@pytest.mark.parametrize("model", sorted(STREAM_ERRORS))
def test_worker_error_inside_a_stream_is_one_event_then_done(error_stack: ErrorStack, model: str) -> None:
    events = _stream_events(error_stack.base_url, model)
    errors = [e for e in events if b'"error"' in e]
    assert len(errors) == 1 and events[-2:] == [errors[0], b"data: [DONE]"]
    assert json.loads(errors[0][6:])["error"]["code"] == "upstream_stream_error"
    raw = b"\n\n".join(events)
    assert b"engine_trace" not in raw and b"object" not in errors[0] and b"after0" not in raw


async def test_async_sdk_raises_on_a_worker_error_inside_a_stream(error_stack: ErrorStack) -> None:
    client = openai.AsyncOpenAI(
        base_url=error_stack.base_url + "/v1", api_key="sk-acme", max_retries=0, timeout=10
    )
    stream = await client.chat.completions.create(
        model="m-err500", messages=[{"role": "user", "content": "async-x"}], stream=True
    )
    with pytest.raises(openai.APIError, match=r"cannot continue after .*async-x"):
        async for _ in stream:
            pass
    await client.close()


def _stream_events(base_url: str, model: str) -> list[bytes]:
    """The raw SSE events of one streamed chat through the gateway."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": True}
    raw = httpx.post(
        base_url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-acme"}, timeout=10
    ).content
    return [e for e in raw.split(b"\n\n") if e]
