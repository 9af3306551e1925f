"""A worker's 5xx that no other worker was asked to compare counts against no worker, whatever cut
the request to one attempt: the client's own retry count (`x-stainless-retry-count`: 2 leaves one
attempt of the default budget of three), or a pool with `retry_attempts: 0`. Otherwise one tenant
sending requests that every worker fails (vLLM's 500 GenerationError for one input), each cut so,
convicted the worker it met whenever another was routable: one worker after another, for every
tenant (`outcome.HeldVerdicts`). A worker that fails what another serves is still counted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.gateway.chat_rig import (
    ChatRig,
    chat_answer,
    chat_app,
    is_prefill_leg,
    prefilled,
    round_robin_gateway,
    served,
)
from tests.support.transports import TRANSPORTS, through

SECRET = b"k"
KEYS = {"t": "sk", "u": "sk-u"}
NAMES = ("a", "b", "p", "q", "c")
POISON = "poison"  # a prompt every worker fails on with a 500
ONE_ATTEMPT = {"x-stainless-retry-count": "2"}  # an SDK's third try: one attempt of three left


@dataclass
class Workers:
    """Scripted workers: a prompt of `POISON` (a vLLM prefill leg's too), or any request to a
    worker in `broken`, gets a 500; anything else is served."""

    posts: list[str] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)


@dataclass
class Rig(ChatRig):
    workers: Workers

    async def chat(
        self,
        model: str,
        prompt: str = "hi",
        *,
        tenant: str = "t",
        stream: bool = False,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream}
        return await self.client.post(
            "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEYS[tenant]}", **(headers or {})},
        )

    def failures(self, pool: str, names: str) -> dict[str, int]:
        return {name: self.worker(pool, name).breaker.failures for name in names}

    def all_closed(self, pool: str, names: str) -> bool:
        return all(self.worker(pool, name).breaker.closed for name in names)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    workers = Workers()

    def app_for(name: str) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            body: dict[str, Any] = await request.json()
            workers.posts.append(name)
            if name in workers.broken or body["messages"][0]["content"] == POISON:
                error = {"error": {"message": "GenerationError", "type": "InternalServerError", "code": 500}}
                return web.json_response(error, status=500)
            if is_prefill_leg(body):
                return prefilled()
            return chat_answer(body.get("stream") is True, "ok")

        return chat_app(chat)

    async with served(NAMES, app_for) as urls:
        # Opens at the first failure counted: any wrong verdict shows as an open breaker. Health
        # checks only at the start: every worker stays healthy, so only breakers decide.
        common = {
            "retry_attempts": 2,
            "breaker": {"failure_threshold": 1, "cooldown_s": 3600},
            "health": {"interval_s": 3600},
        }
        pools = [
            {"name": "two", "models": ["m2"], "workers": [urls["a"], urls["b"]], **common},
            {
                "name": "two0",
                "models": ["m20"],
                "workers": [urls["a"], urls["b"]],
                **common,
                "retry_attempts": 0,
            },
            {
                "name": "pd",
                "models": ["pd"],
                "prefill_workers": [urls["p"], urls["q"]],
                "decode_workers": [urls["c"]],
                "pd": {"protocol": "vllm", "conditional": False},  # a pair whenever one is free
                **common,
            },
        ]
        async with round_robin_gateway(pools, KEYS, SECRET) as gw:
            yield Rig(gw.client, gw.state, urls, workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_one_tenants_requests_cut_to_one_attempt_convict_no_worker(
    rig: Rig, transport: str, stream: bool
) -> None:
    through(rig.state, transport)
    for _ in range(4):  # round robin: two on each worker, each the request's only attempt
        resp = await rig.chat("m2", POISON, stream=stream, headers=ONE_ATTEMPT)
        assert resp.status_code == 502 and resp.headers["x-should-retry"] == "false"
    assert sorted(rig.workers.posts) == ["a", "a", "b", "b"]
    assert rig.failures("two", "ab") == {"a": 0, "b": 0} and rig.all_closed("two", "ab")
    rig.workers.posts.clear()
    for _ in range(4):  # another tenant's requests still go to both workers
        assert (await rig.chat("m2", tenant="u", stream=stream)).status_code == 200
    assert sorted(rig.workers.posts) == ["a", "a", "b", "b"]


async def test_a_pool_without_retries_convicts_no_worker_on_a_lone_5xx(rig: Rig) -> None:
    for _ in range(4):
        assert (await rig.chat("m20", POISON)).status_code == 502
    assert sorted(rig.workers.posts) == ["a", "a", "b", "b"]
    assert rig.failures("two0", "ab") == {"a": 0, "b": 0} and rig.all_closed("two0", "ab")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pd_request_cut_to_one_round_convicts_no_prefill_worker(rig: Rig, stream: bool) -> None:
    for _ in range(4):  # round robin over the two prefill workers, one round each
        resp = await rig.chat("pd", POISON, stream=stream, headers=ONE_ATTEMPT)
        assert resp.status_code == 502
    assert sorted(rig.workers.posts) == ["p", "p", "q", "q"]
    assert rig.failures("pd", "pqc") == dict.fromkeys("pqc", 0) and rig.all_closed("pd", "pqc")
    assert (await rig.chat("pd", tenant="u", stream=stream)).status_code == 200


@pytest.mark.parametrize("taken", [None, "1"])
async def test_a_worker_that_fails_what_another_serves_is_still_counted(rig: Rig, taken: str | None) -> None:
    # A try with an attempt to spare compares: the other worker serves, so the 5xx was the worker's.
    rig.workers.broken.add("a")
    headers = {"x-stainless-retry-count": taken} if taken is not None else {}
    for _ in range(2):  # round robin: one of them starts at `a`
        assert (await rig.chat("m2", tenant="u", headers=headers)).status_code == 200
    assert rig.workers.posts.count("a") == 1
    assert rig.failures("two", "ab") == {"a": 1, "b": 0} and not rig.worker("two", "a").breaker.closed
