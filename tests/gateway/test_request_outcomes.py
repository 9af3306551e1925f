"""The request path's outcomes against a scripted upstream (`request_rig`), through either
transport: what the policy and the worker's breaker learn, worker errors in the gateway's shape,
streams that reached [DONE], malformed answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.disconnect import DisconnectWatch
from policies.base import Outcome
from tests.gateway.request_rig import Rig, request_rig
from tests.support.transports import TRANSPORTS, through


@pytest.fixture
async def rig(tiny_model: Path) -> AsyncIterator[Rig]:
    async with request_rig(tiny_model) as built:
        yield built


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("status", "outcome", "client_status"),
    [
        (200, Outcome.SERVED, 200),
        (400, Outcome.REJECTED, 400),
        (500, Outcome.WORKER_FAILED, 502),
        (401, Outcome.WORKER_FAILED, 502),
        (403, Outcome.WORKER_FAILED, 502),
    ],
)
async def test_policy_learns_the_outcome(
    rig: Rig, status: int, outcome: Outcome, client_status: int, transport: str
) -> None:
    through(rig.state, transport)
    rig.upstream.status = status
    resp = await rig.chat()
    assert resp.status_code == client_status
    (obs,) = rig.policy.observations
    assert obs.outcome is outcome and obs.failed == (outcome is not Outcome.SERVED)
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    # A 4xx says nothing about the worker's health; a 5xx, or a refusal of the gateway's own
    # credentials, would count against its breaker if another worker could take its requests,
    # but this is the pool's only one (tests/gateway/test_worker_5xx_said.py).
    assert worker.breaker.failures == 0 and worker.breaker.closed


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [401, 403])
async def test_a_worker_refusing_the_gateways_credentials_is_not_the_clients_401(
    rig: Rig, transport: str, stream: bool, status: int
) -> None:
    # The client's key was good (the gateway admitted it); only the pool's worker key can be
    # wrong. Passed through, the SDK raised AuthenticationError and the worker stayed routable.
    through(rig.state, transport)
    rig.upstream.status = status
    rig.upstream.error_body = {"error": "Unauthorized"}
    resp = await rig.chat(stream=stream)
    assert resp.status_code == 502
    error = orjson.loads(resp.content)["error"]
    assert (error["type"], error["code"]) == ("server_error", "worker_auth_failed")
    assert error["message"] == f"the worker refused the gateway's credentials (HTTP {status})"


@pytest.mark.parametrize(
    ("status", "worker_body", "expected"),
    [
        (  # vLLM today: nested, with a class name for type and the status as an integer code
            400,
            {
                "error": {
                    "message": "max_tokens is too large",
                    "type": "BadRequestError",
                    "param": "max_tokens",
                    "code": 400,
                }
            },
            {
                "message": "max_tokens is too large",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": None,
            },
        ),
        (  # older vLLM: the fields at the top level
            404,
            {
                "object": "error",
                "message": "The model `x` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            },
            {
                "message": "The model `x` does not exist.",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
        (
            429,
            {"error": {"message": "slow down", "type": "RateLimitError", "code": "too_many"}},
            {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "too_many"},
        ),
        (
            422,
            b"<html>not json</html>",
            {
                "message": "the worker refused the request (HTTP 422)",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
    ],
)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_worker_errors_are_passed_through_in_the_gateway_shape(
    rig: Rig, status: int, worker_body: Any, expected: dict[str, Any], transport: str
) -> None:
    through(rig.state, transport)
    rig.upstream.status = status
    rig.upstream.error_body = worker_body
    for stream in (False, True):
        resp = await rig.chat(stream=stream)
        assert resp.status_code == status
        assert resp.headers["content-type"].startswith("application/json")
        assert orjson.loads(resp.content) == {"error": expected}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stream_that_reached_done_is_a_success_whatever_the_socket_does_next(
    rig: Rig, transport: str
) -> None:
    through(rig.state, transport)
    # The disconnect watcher runs from 20 ms on, and the worker ends its body 50 ms after [DONE]:
    # the client's response is complete by then, which its receive() reports as a disconnect.
    rig.state.lifecycle.disconnects = DisconnectWatch(delay_s=0.02)
    rig.upstream.chunk_pause_s = 0.03
    rig.upstream.tail_pause_s = 0.05
    streams = 5
    for _ in range(streams):
        resp = await rig.chat(stream=True)
        assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
    assert [obs.outcome for obs in rig.policy.observations] == [Outcome.SERVED] * streams
    statuses = {values[2] for values in rig.state.routing.metrics.requests.children}
    assert statuses == {"200"}
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    assert worker.breaker.failures == 0 and worker.in_flight == 0
    # Read to its end, each connection went back to the pool (closing it would take one per
    # stream). The lean client reuses the one it has; aiohttp's pool hands out its oldest idle
    # connection first, some of them opened by health checks.
    if transport == "lean":
        assert len(rig.upstream.peers) == 1
    else:
        assert len(rig.upstream.peers) < streams


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_malformed_answer_is_a_502_and_counts_against_the_worker(
    rig: Rig, transport: str, stream: bool
) -> None:
    through(rig.state, transport)
    rig.upstream.garbage = b"<html>502 from a proxy in front of the worker</html>"
    resp = await rig.chat(stream=stream)
    assert resp.status_code == 502 and resp.headers["content-type"] == "application/json"
    error = orjson.loads(resp.content)["error"]
    assert (error["type"], error["code"]) == ("server_error", "bad_gateway")
    assert error["message"].startswith("worker sent a malformed")
    (obs,) = rig.policy.observations
    assert obs.outcome is Outcome.WORKER_FAILED
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    assert worker.breaker.failures == 1 and worker.in_flight == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_over_the_size_bound_is_the_requests_502_not_the_workers(
    rig: Rig, transport: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the request asked for is more than one answer may hold: no worker would answer less,
    # so the worker's breaker is not told (a client repeating it would otherwise open every
    # worker's breaker for every tenant) and the client is told not to retry.
    through(rig.state, transport)
    monkeypatch.setattr("gateway.upstream_conn.MAX_ANSWER_BYTES", 1000)
    pad = b"a" * 5000
    if stream:  # a streamed request's whole-answer path: the worker's 4xx is read whole
        rig.upstream.status = 400
        rig.upstream.error_body = b'{"error": {"message": "' + pad + b'"}}'
    else:
        rig.upstream.garbage = b'{"choices": [], "pad": "' + pad + b'"}'
    for _ in range(3):
        resp = await rig.chat(stream=stream, headers={"x-stainless-retry-count": "0"})
        assert resp.status_code == 502 and resp.headers["x-should-retry"] == "false"
        assert resp.headers.get_list("x-should-retry") == ["false"] and "retry-after" not in resp.headers
        error = orjson.loads(resp.content)["error"]
        assert error["code"] == "answer_too_large" and "ask for less" in error["message"]
    assert [obs.outcome for obs in rig.policy.observations] == [Outcome.ABORTED] * 3
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    assert worker.breaker.failures == 0 and worker.breaker.closed and worker.in_flight == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_oversized_stream_event_is_a_502_whatever_the_transport(rig: Rig, transport: str) -> None:
    through(rig.state, transport)
    # One event larger than the relay holds (4 MiB), before anything reached the client.
    rig.upstream.garbage = b'{"pad": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    resp = await rig.chat(stream=True)
    assert resp.status_code == 502
    error = orjson.loads(resp.content)["error"]
    assert error["message"] == "worker sent a malformed stream (an oversized SSE event)"
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    assert worker.breaker.failures == 1 and worker.in_flight == 0
