"""A gateway process that does not know a stored response's holder looks for it on the workers
(`responses_search.find_holder`), and a worker that could not tell is no proof that the response
does not exist: the holder busy (its 503 or 529 with `Retry-After`), unreachable or too slow to
answer. When no other worker holds the response, the client of `GET /v1/responses/{id}`, its
`cancel` and a follow-up naming it (`previous_response_id`) gets a 503 it may retry, with the busy
worker's `Retry-After` (the gateway's 1 s otherwise), never the 404 that the OpenAI SDKs do not
retry. Before, each of these was passed over and the client was told "not found".

A fresh gateway in front of three scripted workers (`routes_worker`) plays the process that did not
route the response (another process, a replica, or one restarted)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.config.pool import PoolConfig
from gateway.errors import ApiError
from gateway.registry import Pool
from gateway.responses_search import find_holder
from gateway.worker import Worker
from policies.baselines import RoundRobin
from tests.gateway.routes_rig import KEY, SECRET, config
from tests.gateway.routes_worker import RoutesWorker, start
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.wait import wait_until

BUSY_BODY = {"error": {"message": "Server busy, try again later", "type": "ServiceUnavailable"}}


@dataclass
class StoreWorker(RoutesWorker):
    """A `RoutesWorker` whose reads of stored responses (`GET`, `cancel`) answer `busy` (a 503 or a
    529, with `Retry-After: retry_after` when set) or wait for `hang` to be set, while either is."""

    busy: int | None = None
    retry_after: str | None = None
    hang: asyncio.Event | None = None
    reads: list[str] = field(default_factory=list)

    async def _get_response(self, request: web.Request) -> web.Response:
        self.reads.append(request.path)
        if self.hang is not None:
            await self.hang.wait()
        if self.busy is None:
            return await super()._get_response(request)
        await self._record(request)
        headers = {} if self.retry_after is None else {"Retry-After": self.retry_after}
        return web.json_response(BUSY_BODY, status=self.busy, headers=headers)

    async def _cancel_response(self, request: web.Request) -> web.Response:
        if self.busy is None:
            return await super()._cancel_response(request)
        return await self._get_response(request)


@dataclass
class Fleet:
    workers: list[StoreWorker]
    runners: list[web.AppRunner]

    def holder(self, rid: str) -> StoreWorker:
        (held,) = [w for w in self.workers if rid in w.responses]
        return held

    def posts(self) -> int:
        return sum(r.path == "/v1/responses" for w in self.workers for r in w.received)


@contextlib.asynccontextmanager
async def fleet(n: int = 3) -> AsyncIterator[Fleet]:
    workers = [StoreWorker(f"w{i + 1}") for i in range(n)]
    runners = [await start(w) for w in workers]
    try:
        yield Fleet(workers, runners)
    finally:
        for w in workers:
            if w.hang is not None:
                w.hang.set()
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(
    f: Fleet, pool: dict[str, Any] | None = None, workers_up: bool = True
) -> AsyncIterator[InProcessGateway]:
    """One gateway process of the deployment: it knows only the ids it routed itself."""
    built = config([w.url for w in f.workers], pool)
    async with gateway_in_process(built, RoundRobin(), secret=SECRET, workers_up=workers_up) as gw:
        yield gw


async def _stored(f: Fleet) -> str:
    """A response stored through a gateway process that is gone: its id."""
    async with gateway(f) as first:
        created = await first.client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=KEY)
        assert created.status_code == 200, created.text
        rid: str = created.json()["id"]
        return rid


async def _asked(client: httpx.AsyncClient, rid: str) -> list[httpx.Response]:
    """A retrieve, a cancel and a follow-up naming `rid`."""
    follow_up = {"model": "m", "input": "next", "previous_response_id": rid}
    return [
        await client.get(f"/v1/responses/{rid}", headers=KEY),
        await client.post(f"/v1/responses/{rid}/cancel", headers=KEY),
        await client.post("/v1/responses", json=follow_up, headers=KEY),
    ]


def _assert_retryable(answers: list[httpx.Response], code: str, retry_after: str) -> None:
    for answer, param in zip(answers, (None, None, "previous_response_id"), strict=True):
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("server_error", code, param)
        assert error["message"].startswith("could not tell whether the response exists: ")
        assert answer.headers["retry-after"] == retry_after
        assert answer.headers["x-request-id"]


@pytest.mark.parametrize(("status", "code"), [(503, "worker_unavailable"), (529, "worker_overloaded")])
@pytest.mark.parametrize(("retry_after", "told"), [("7", "7"), (None, "1"), ("5 \u20ac", "1")])
async def test_a_busy_holder_found_by_the_search_is_a_503_with_its_retry_after(
    status: int, code: str, retry_after: str | None, told: str
) -> None:
    """A `Retry-After` that is not latin-1 is dropped (the gateway's 1 s), not a 500."""
    async with fleet() as f:
        rid = await _stored(f)
        holder = f.holder(rid)
        holder.busy, holder.retry_after = status, retry_after
        async with gateway(f) as gw:
            posts = f.posts()
            _assert_retryable(await _asked(gw.client, rid), code, told)
            assert f.posts() == posts  # no worker was sent the follow-up
            # Every worker was asked (the others say 404), and the busy one is not remembered.
            assert all(f"/v1/responses/{rid}" in w.reads for w in f.workers)
            assert len(gw.state.gate.responses) == 0
            holder.busy = None  # no longer busy: the client's retry finds it
            got = await gw.client.get(f"/v1/responses/{rid}", headers=KEY)
            assert (got.status_code, got.json()["id"]) == (200, rid)
            follow_up = {"model": "m", "input": "next", "previous_response_id": rid}
            resp = await gw.client.post("/v1/responses", json=follow_up, headers=KEY)
            assert resp.status_code == 200, resp.text
            assert holder.received[-1].json()["previous_response_id"] == rid


async def test_a_busy_worker_does_not_hide_the_worker_that_holds_it() -> None:
    async with fleet() as f:
        rid = await _stored(f)
        holder = f.holder(rid)
        for w in f.workers:
            if w is not holder:
                w.busy, w.retry_after = 529, "30"
        async with gateway(f) as gw:
            got, cancel, follow_up = await _asked(gw.client, rid)
            assert (got.status_code, got.json()["id"]) == (200, rid)
            assert (cancel.status_code, cancel.json()["error"]["message"]) == (400, "cannot cancel")
            assert follow_up.status_code == 200, follow_up.text
            assert holder.received[-1].json()["previous_response_id"] == rid


async def test_a_holder_that_does_not_answer_in_time_is_a_503_not_a_404() -> None:
    """The holder hangs: the search waits for it no longer than the pool's `read_s` (here shorter
    than the search's own bound, `ASK_S`), then says the response may exist."""
    async with fleet() as f:
        rid = await _stored(f)
        f.holder(rid).hang = asyncio.Event()
        async with gateway(f, {"timeouts": {"read_s": 0.5}}) as gw:
            _assert_retryable(await _asked(gw.client, rid), "worker_unavailable", "1")


async def test_a_holder_that_is_gone_is_a_503_until_it_leaves_the_pool() -> None:
    """The holder's process is gone (connections refused, then its health checks fail): the
    response may come back with it, so a 503; once the pool no longer lists it, the 404."""
    async with fleet() as f:
        rid = await _stored(f)
        holder = f.holder(rid)
        await f.runners[f.workers.index(holder)].cleanup()
        async with gateway(f, workers_up=False) as gw:
            others = [w for w in gw.state.registry.pools["p"].workers.values() if w.url != holder.url]
            await wait_until(lambda: all(w.healthy for w in others), what="the other workers are up")
            _assert_retryable(await _asked(gw.client, rid), "worker_unavailable", "1")
            gw.state.registry.pools["p"].set_urls([w.url for w in f.workers if w is not holder])
            for answer in await _asked(gw.client, rid):
                assert answer.status_code == 404, answer.text
                assert answer.json()["error"]["param"] == "response_id"


async def test_the_search_is_bounded_in_time() -> None:
    """Workers that never answer: the search ends after its budget, whatever the pool's timeouts,
    and the workers it had no time for are not asked."""
    pool = Pool(PoolConfig(name="a", models=["m"], workers=["http://a1:1", "http://a2:1"]))
    for worker in pool.workers.values():
        worker.healthy = True
    asked: list[str] = []
    never = asyncio.Event()

    async def ask(pool: Pool, worker: Worker) -> str | None:
        asked.append(worker.url)
        await never.wait()
        return None

    with pytest.raises(ApiError) as undecided:
        await find_holder((pool,), ask, "previous_response_id", budget_s=0.2)
    assert (undecided.value.status, undecided.value.code) == (503, "worker_unavailable")
    assert undecided.value.param == "previous_response_id"
    assert asked == ["http://a1:1"]
