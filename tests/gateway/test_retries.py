"""Retry semantics: one budget per client call, the gateway's advice, a worker's Retry-After."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.retries import advice, attempts_allowed, forwardable, retries_taken
from gateway.state import GatewayState
from policies import make_policy
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.transports import TRANSPORTS, through

SECRET = b"k"
NO = [(b"x-should-retry", b"false")]


def test_the_client_retry_count_is_read_only_when_it_is_a_small_integer() -> None:
    assert [retries_taken(v) for v in (b"0", b"2", b"999", b"1000", b"-1", b"x", b"")] == [
        0,
        2,
        100,
        0,
        0,
        0,
        0,
    ]


def test_a_try_spends_what_earlier_tries_left_and_always_gets_one_attempt() -> None:
    assert [attempts_allowed(2, taken) for taken in range(5)] == [3, 2, 1, 1, 1]
    assert attempts_allowed(0, 0) == 1


@pytest.mark.parametrize(
    ("made", "retry_attempts", "taken", "expected"),
    [
        (0, 2, 0, []),  # no worker tried: retrying sends nothing twice
        (1, 2, 0, []),  # one attempt, budget left: the SDK's retry is the call's next attempt
        (1, 0, 0, NO),  # the budget was one attempt
        (1, 2, 2, NO),  # the third try of a call whose budget is three
        (2, 2, 0, NO),  # the gateway retried
        (3, 5, 0, NO),
    ],
)
def test_advice_forbids_a_retry_once_the_gateway_retried_or_the_budget_is_spent(
    made: int, retry_attempts: int, taken: int, expected: list[tuple[bytes, bytes]]
) -> None:
    assert advice(made, retry_attempts, taken) == expected


def test_only_plain_numbers_of_retry_after_are_forwarded() -> None:
    hints = ((b"retry-after", b" 7 "), (b"retry-after-ms", b"6500.5"))
    assert forwardable(hints) == [(b"retry-after", b"7"), (b"retry-after-ms", b"6500.5")]
    bad = ((b"retry-after", b"Wed, 21 Oct 2015 07:28:00 GMT"), (b"retry-after-ms", b"1e9"))
    assert forwardable(bad) == []
    assert forwardable(((b"retry-after", b"12345678"),)) == []  # more than a quarter of a year


@dataclass
class Workers:
    """Scripted workers: each answers every completion with `status` and `headers`."""

    status: int = 500
    headers: dict[str, str] = field(default_factory=dict)
    script: list[int] = field(default_factory=list)  # the next POSTs' statuses, in turn, before `status`
    posts: list[str] = field(default_factory=list)  # the port of each completion POST


@dataclass
class Rig:
    client: httpx.AsyncClient
    workers: Workers
    state: GatewayState

    async def chat(
        self, model: str, stream: bool = False, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": stream}
        sent = {"authorization": "Bearer sk", **(headers or {})}
        return await self.client.post("/v1/chat/completions", json=body, headers=sent)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    workers = Workers()

    def app_for(port_name: str) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def chat(_: web.Request) -> web.Response:
            workers.posts.append(port_name)
            return web.json_response(
                {"error": {"message": "busy"}},
                status=workers.script.pop(0) if workers.script else workers.status,
                headers=workers.headers,
            )

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/chat/completions", chat)
        return app

    runners, urls = [], []
    for name in ("a", "b", "c"):
        runner, port = await serve_app(app_for(name))
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    breaker = {"failure_threshold": 1000}
    config = parse_config(
        {
            "pools": [
                {"name": "three", "models": ["m3"], "workers": urls, "retry_attempts": 2, "breaker": breaker},
                {
                    "name": "two",
                    "models": ["m2"],
                    "workers": urls[:2],
                    "retry_attempts": 1,
                    "breaker": breaker,
                },
                {
                    "name": "one",
                    "models": ["m1"],
                    "workers": urls[:1],
                    "retry_attempts": 2,
                    "breaker": breaker,
                },
                {
                    "name": "none",
                    "models": ["m0"],
                    "workers": urls[:1],
                    "retry_attempts": 0,
                    "breaker": breaker,
                },
            ],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
            "scrape": {"enabled": False},
        }
    )
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            yield Rig(gw.client, workers, gw.state)
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_429_reaches_the_client_with_its_retry_after(
    rig: Rig, transport: str, stream: bool
) -> None:
    through(rig.state, transport)
    rig.workers.status = 429
    rig.workers.headers = {"Retry-After": "7", "retry-after-ms": "6500"}
    resp = await rig.chat("m1", stream)
    assert resp.status_code == 429 and resp.json()["error"]["type"] == "rate_limit_error"
    assert (resp.headers["retry-after"], resp.headers["retry-after-ms"]) == ("7", "6500")
    # One attempt of a budget of three: the SDK may retry, honouring the worker's advice.
    assert "x-should-retry" not in resp.headers
    assert len(rig.workers.posts) == 1
    resp = await rig.chat("m0", stream)  # a budget of one attempt, spent
    assert resp.status_code == 429 and resp.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_workers_503_is_a_503_with_the_workers_retry_after_which_the_sdk_may_honour(
    rig: Rig, transport: str, stream: bool
) -> None:
    # Overloaded or starting workers asked to be retried later and spent nothing on the request:
    # the client may retry after their Retry-After, as it would talking to a worker directly, even
    # when the gateway retried or the call's budget is spent (a short overload then passes).
    through(rig.state, transport)
    rig.workers.status = 503
    rig.workers.headers = {"Retry-After": "5"}
    for taken in ("0", "2"):
        resp = await rig.chat("m2", stream, headers={"x-stainless-retry-count": taken})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "worker_unavailable"
        assert resp.headers["retry-after"] == "5" and "x-should-retry" not in resp.headers
    # The first call tried both workers; the third try of a call, one (its budget's last).
    assert sorted(rig.workers.posts[:2]) == ["a", "b"] and len(rig.workers.posts) == 3


async def test_a_503_after_attempts_that_cost_work_still_spends_the_calls_budget(rig: Rig) -> None:
    # Only a try whose every attempt asked to be retried later leaves the client free to retry:
    # one 500 in it (a worker computed and failed) and the budget rule stands, whatever came last.
    rig.workers.script = [500, 503] * 2  # each call: its first worker fails, the other is busy
    rig.workers.headers = {"Retry-After": "2"}
    for _ in range(2):
        resp = await rig.chat("m2")
        assert resp.status_code == 503 and resp.headers["x-should-retry"] == "false"
    assert len(rig.workers.posts) == 4


async def test_a_request_every_worker_refuses_with_403_opens_no_breaker(rig: Rig) -> None:
    # A proxy in front of the workers refusing the request itself (a WAF): several workers
    # refusing one request point at the request, as several 5xx do, not at each worker.
    rig.workers.status = 403
    for _ in range(3):
        resp = await rig.chat("m3")
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "worker_auth_failed"
    assert len(rig.workers.posts) == 9
    workers = rig.state.registry.pools["three"].workers.values()
    assert [w.breaker.failures for w in workers] == [0, 0, 0]


async def test_a_503_without_retry_after_still_says_when_to_retry(rig: Rig) -> None:
    rig.workers.status = 503
    resp = await rig.chat("m0")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"


@pytest.mark.parametrize(("taken", "attempts"), [(None, 3), ("0", 3), ("1", 2), ("2", 1), ("7", 1)])
async def test_the_sdks_earlier_tries_come_out_of_the_calls_budget(
    rig: Rig, taken: str | None, attempts: int
) -> None:
    headers = {"x-stainless-retry-count": taken} if taken is not None else {}
    resp = await rig.chat("m3", headers=headers)
    assert resp.status_code == 502 and resp.headers["x-should-retry"] == "false"
    assert len(rig.workers.posts) == attempts


async def test_a_single_worker_pool_leaves_the_retry_to_the_sdk_within_the_budget(rig: Rig) -> None:
    answers: list[Any] = []
    for taken in ("0", "1", "2"):
        resp = await rig.chat("m1", headers={"x-stainless-retry-count": taken})
        answers.append((resp.status_code, resp.headers.get("x-should-retry")))
    assert answers == [(502, None), (502, None), (502, "false")]
    assert len(rig.workers.posts) == 3  # 1 + retry_attempts, across the SDK's three tries
