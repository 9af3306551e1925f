"""A client's own `request_id` reused: every `POST /v1/responses` still creates a response of its own
id, so no two workers ever hold the same id. A follow-up, retrieve or cancel of each response
reaches the worker holding that response, through the gateway that routed it, through another one
that never saw it, and after a restart; one tenant's reuse of a value never touches another's
responses."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.gateway.routes_rig import KEY, SECRET, Recording, config
from tests.gateway.routes_worker import RoutesWorker, start
from tests.support.inprocess import InProcessGateway, gateway_in_process

OTHER = {"authorization": "Bearer sk-other"}


@contextlib.asynccontextmanager
async def workers(n: int) -> AsyncIterator[list[RoutesWorker]]:
    started = [RoutesWorker(f"w{i + 1}") for i in range(n)]
    runners = [await start(w) for w in started]
    try:
        yield started
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(fleet: list[RoutesWorker]) -> AsyncIterator[InProcessGateway]:
    """One gateway process of the deployment (round_robin; it knows only what it routes itself)."""
    async with gateway_in_process(config([w.url for w in fleet]), Recording(), secret=SECRET) as gw:
        yield gw


def holders(fleet: list[RoutesWorker], rid: str) -> list[str]:
    return [w.name for w in fleet if rid in w.responses]


async def create(client: httpx.AsyncClient, key: dict[str, str], stream: bool, **extra: Any) -> str:
    body = {"model": "m", "input": "hello", "stream": stream, **extra}
    resp = await client.post("/v1/responses", json=body, headers=key)
    assert resp.status_code == 200, resp.text
    if stream:
        return resp.content.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    rid: str = resp.json()["id"]
    return rid


async def reaches_its_holder(
    client: httpx.AsyncClient, fleet: list[RoutesWorker], rid: str, key: dict[str, str] = KEY
) -> None:
    """A retrieve, a cancel and a follow-up of `rid` go to the one worker holding it."""
    (holder,) = [w for w in fleet if rid in w.responses]
    got = await client.get(f"/v1/responses/{rid}", headers=key)
    assert got.status_code == 200 and got.json()["id"] == rid
    assert holder.received[-1].path == f"/v1/responses/{rid}"
    cancel = await client.post(f"/v1/responses/{rid}/cancel", headers=key)
    assert (cancel.status_code, cancel.json()["error"]["message"]) == (400, "cannot cancel")
    assert holder.received[-1].path == f"/v1/responses/{rid}/cancel"
    body = {"model": "m", "input": "next", "previous_response_id": rid}
    follow_up = await client.post("/v1/responses", json=body, headers=key)
    assert follow_up.status_code == 200, follow_up.text
    assert holder.received[-1].json()["previous_response_id"] == rid


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reused_request_id_names_a_new_response_each_time(stream: bool) -> None:
    async with workers(2) as fleet:
        async with gateway(fleet) as first:
            # round_robin: the first and the third on one worker, the second on the other.
            rids = [await create(first.client, KEY, stream, request_id="conv-42") for _ in range(3)]
            assert len(set(rids)) == 3
            assert all(rid.startswith("conv-42_") for rid in rids)
            placed = [holders(fleet, rid) for rid in rids]
            assert placed[0] == placed[2] and sorted(placed[:2]) == [["w1"], ["w2"]]
            # The gateway that routed both still sends each id to its own worker.
            for rid in rids:
                await reaches_its_holder(first.client, fleet, rid)
        # So does a gateway that never saw them (another process or replica, or a restart): it
        # finds each id on its one holder, whichever worker it asks first.
        for rid in reversed(rids):
            async with gateway(fleet) as restarted:
                await reaches_its_holder(restarted.client, fleet, rid)


async def test_one_tenants_reuse_of_a_value_never_touches_anothers_responses() -> None:
    async with workers(2) as fleet, gateway(fleet) as gw:
        mine = await create(gw.client, KEY, False, request_id="shared-name")
        theirs = await create(gw.client, OTHER, False, request_id="shared-name")
        again = await create(gw.client, OTHER, False, request_id="shared-name")
        assert len({mine, theirs, again}) == 3
        # round_robin: the first and the third on one worker, the second on the other.
        first, second, third = (holders(fleet, rid) for rid in (mine, theirs, again))
        assert first == third and sorted([first, second]) == [["w1"], ["w2"]]
        for rid, key in ((mine, KEY), (theirs, OTHER), (again, OTHER)):
            await reaches_its_holder(gw.client, fleet, rid, key)
        for rid, stranger in ((mine, OTHER), (theirs, KEY), (again, KEY)):
            asked = sum(len(w.received) for w in fleet)
            assert (await gw.client.get(f"/v1/responses/{rid}", headers=stranger)).status_code == 404
            assert sum(len(w.received) for w in fleet) == asked
