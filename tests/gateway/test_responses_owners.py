"""Who owns a stored response is told from its id alone, the same in every gateway of one
deployment: two gateways sharing the key-hash secret in front of the same workers (as the
processes of `kvgate serve --processes N`, or replicas), each knowing only the ids it routed, and
a gateway started after the response was stored. Another tenant naming the id gets vLLM's 404 from
every gateway, and no worker hears of it; its owner continues, retrieves and cancels it through
any of them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web

from tests.gateway.routes_rig import KEY, SECRET, Recording, config
from tests.gateway.routes_worker import RoutesWorker, start
from tests.support.inprocess import InProcessGateway, gateway_in_process

OTHER = {"authorization": "Bearer sk-other"}


@dataclass
class Fleet:
    workers: list[RoutesWorker]
    runners: list[web.AppRunner]

    def received(self) -> int:
        return sum(len(w.received) for w in self.workers)

    def counts(self, posts: bool | None = None) -> dict[str, int]:
        """Requests each worker received: all of them, only `POST /v1/responses` (True), or only
        the others (False: retrieves and cancels)."""
        return {
            w.name: sum(posts is None or (r.path == "/v1/responses") == posts for r in w.received)
            for w in self.workers
        }

    def holder(self, rid: str) -> RoutesWorker:
        (held,) = [w for w in self.workers if rid in w.responses]
        return held


@contextlib.asynccontextmanager
async def fleet(n: int) -> AsyncIterator[Fleet]:
    workers = [RoutesWorker(f"w{i + 1}") for i in range(n)]
    runners = [await start(w) for w in workers]
    try:
        yield Fleet(workers, runners)
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(workers: Fleet) -> AsyncIterator[InProcessGateway]:
    """One gateway of the deployment (its own state: it knows only what it routes itself)."""
    built = config([w.url for w in workers.workers])
    async with gateway_in_process(built, Recording(), secret=SECRET) as gw:
        yield gw


async def _create(client: httpx.AsyncClient, stream: bool = False, **extra: object) -> str:
    body = {"model": "m", "input": "A's private words", "stream": stream, **extra}
    resp = await client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 200
    if stream:
        return resp.content.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    rid: str = resp.json()["id"]
    return rid


async def _probes(client: httpx.AsyncClient, rid: str, stream: bool) -> list[tuple[int, object]]:
    """Tenant "other"'s follow-up, retrieve and cancel naming `rid`: (status, error) each, the id
    in the message replaced, so that two ids' answers compare."""
    follow_up = {"model": "m", "input": "repeat it", "previous_response_id": rid, "stream": stream}
    answers = [
        await client.post("/v1/responses", json=follow_up, headers=OTHER),
        await client.get(f"/v1/responses/{rid}", headers=OTHER),
        await client.post(f"/v1/responses/{rid}/cancel", headers=OTHER),
    ]
    out: list[tuple[int, object]] = []
    for resp in answers:
        error = resp.json()["error"]
        out.append((resp.status_code, {**error, "message": error["message"].replace(rid, "ID")}))
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_another_tenant_is_refused_by_every_gateway_and_the_owner_served_by_each(stream: bool) -> None:
    async with fleet(1) as workers, gateway(workers) as first, gateway(workers) as second:
        rid = await _create(first.client, stream)
        assert len(first.state.gate.responses) == 1 and len(second.state.gate.responses) == 0
        before = workers.received()
        made_up = "resp_" + "0" * 32 + "_" + "a" * 24
        unknown = await _probes(first.client, made_up, stream)
        assert all(status == 404 for status, _ in unknown)
        for gw in (first, second):
            # The same answers as for an id nobody holds, and nothing reaches the worker.
            assert await _probes(gw.client, rid, stream) == unknown
        assert workers.received() == before
        # Its owner continues the conversation through either gateway: the worker gets the id.
        for gw in (first, second):
            body = {"model": "m", "input": "next", "previous_response_id": rid}
            resp = await gw.client.post("/v1/responses", json=body, headers=KEY)
            assert resp.status_code == 200, resp.text
            assert workers.workers[0].received[-1].json()["previous_response_id"] == rid
            got = await gw.client.get(f"/v1/responses/{rid}", headers=KEY)
            assert got.status_code == 200 and got.json()["id"] == rid
            cancel = await gw.client.post(f"/v1/responses/{rid}/cancel", headers=KEY)
            assert (cancel.status_code, cancel.json()["error"]["message"]) == (400, "cannot cancel")


async def test_a_gateway_started_after_the_response_was_stored_serves_its_owner_only() -> None:
    async with fleet(1) as workers:
        async with gateway(workers) as before_restart:
            rid = await _create(before_restart.client)
        async with gateway(workers) as restarted:
            asked = workers.received()
            assert all(status == 404 for status, _ in await _probes(restarted.client, rid, False))
            assert workers.received() == asked
            body = {"model": "m", "input": "next", "previous_response_id": rid}
            resp = await restarted.client.post("/v1/responses", json=body, headers=KEY)
            assert resp.status_code == 200, resp.text
            assert (await restarted.client.get(f"/v1/responses/{rid}", headers=KEY)).json()["id"] == rid


async def test_a_retrieve_of_an_id_the_gateway_does_not_know_finds_its_holder_once() -> None:
    async with fleet(2) as workers, gateway(workers) as first, gateway(workers) as second:
        rids = [await _create(first.client) for _ in range(2)]  # round_robin: one on each worker
        assert {workers.holder(rid).name for rid in rids} == {"w1", "w2"}
        for rid in rids:
            holder = workers.holder(rid)
            got = await second.client.get(f"/v1/responses/{rid}", headers=KEY)
            assert got.status_code == 200 and got.json()["id"] == rid
            # Now known here: the next retrieve goes to its holder alone.
            asked = workers.counts()
            assert (await second.client.get(f"/v1/responses/{rid}", headers=KEY)).status_code == 200
            after = workers.counts()
            assert {name: after[name] - asked[name] for name in after} == {
                w.name: int(w is holder) for w in workers.workers
            }
        # An id of its own that no worker holds: every worker says 404, and so does the gateway.
        gone = second.state.gate.responses.ids.mint("t")
        resp = await second.client.get(f"/v1/responses/{gone}", headers=KEY)
        assert resp.status_code == 404
        assert resp.json()["error"]["message"] == f"Response with id '{gone}' not found."


async def test_a_follow_up_of_an_id_the_gateway_does_not_know_reaches_its_holder() -> None:
    async with fleet(2) as workers, gateway(workers) as first, gateway(workers) as second:
        rids = [await _create(first.client) for _ in range(2)]  # round_robin: one on each worker
        assert {workers.holder(rid).name for rid in rids} == {"w1", "w2"}
        for rid in rids:
            holder = workers.holder(rid)
            for _ in range(2):  # found by asking the workers, then known here
                posts = workers.counts(posts=True)
                body = {"model": "m", "input": "next", "previous_response_id": rid}
                resp = await second.client.post("/v1/responses", json=body, headers=KEY)
                assert resp.status_code == 200, resp.text
                after = workers.counts(posts=True)
                assert {name: after[name] - posts[name] for name in after} == {
                    w.name: int(w is holder) for w in workers.workers
                }
                assert holder.received[-1].json()["previous_response_id"] == rid
        # Known now: the next follow-up asks no worker first.
        gets = workers.counts(posts=False)
        body = {"model": "m", "input": "again", "previous_response_id": rids[0]}
        assert (await second.client.post("/v1/responses", json=body, headers=KEY)).status_code == 200
        assert workers.counts(posts=False) == gets
        # An id of its own that no worker holds: vLLM's 404, and no worker gets the follow-up.
        gone = second.state.gate.responses.ids.mint("t")
        posts_before = workers.counts(posts=True)
        body = {"model": "m", "input": "next", "previous_response_id": gone}
        resp = await second.client.post("/v1/responses", json=body, headers=KEY)
        assert resp.status_code == 404
        assert resp.json()["error"]["message"] == f"Response with id '{gone}' not found."
        assert workers.counts(posts=True) == posts_before
