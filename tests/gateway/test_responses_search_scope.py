"""A stored response this process does not know is looked for in the pool that created it only:
its id names the served model it was created for (its scope, `responses_ids`), which picked that
pool (`responses_search.pools_to_search`). Before, a `GET` or `cancel` searched every pool, and
one worker down anywhere (an embeddings pool's, which never holds a response) turned vLLM's 404
for an expired id into a 503 for as long as it was down. An id without a scope (minted before
ids had one), or naming no model served now, is still looked for in every pool; another tenant's
id is still a 404 that reaches no worker.

A fresh gateway in front of two scripted workers (`routes_worker`) and an embeddings pool whose
one worker is down plays the process that did not route the response."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from policies.baselines import RoundRobin
from tests.gateway.routes_rig import KEY, SECRET, config
from tests.gateway.test_responses_holder_busy import Fleet, fleet, gateway
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.processes import free_port
from tests.support.wait import wait_until

OTHER = {"authorization": "Bearer sk-other"}


async def _stored(f: Fleet) -> str:
    """A response stored through a gateway process that is gone, then lost by its worker (it
    restarted, or the response expired): its id."""
    async with gateway(f) as first:
        created = await first.client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=KEY)
        assert created.status_code == 200, created.text
        rid: str = created.json()["id"]
    f.holder(rid).responses.clear()
    return rid


@contextlib.asynccontextmanager
async def _with_a_dead_embeddings_pool(f: Fleet) -> AsyncIterator[InProcessGateway]:
    built = config([w.url for w in f.workers])
    built["pools"].append({"name": "embed", "models": ["e5"], "workers": [f"http://127.0.0.1:{free_port()}"]})
    async with gateway_in_process(built, RoundRobin(), secret=SECRET, workers_up=False) as gw:
        chat = list(gw.state.registry.pools["p"].workers.values())
        await wait_until(lambda: all(w.healthy for w in chat), what="the chat workers are up")
        assert not any(w.healthy for w in gw.state.registry.pools["embed"].workers.values())
        yield gw


async def _asked(client: httpx.AsyncClient, rid: str, headers: dict[str, str] = KEY) -> list[httpx.Response]:
    return [
        await client.get(f"/v1/responses/{rid}", headers=headers),
        await client.post(f"/v1/responses/{rid}/cancel", headers=headers),
    ]


async def test_an_expired_id_is_a_404_though_a_worker_of_another_pool_is_down() -> None:
    async with fleet(2) as f:
        rid = await _stored(f)
        async with _with_a_dead_embeddings_pool(f) as gw:
            for answer in await _asked(gw.client, rid):
                assert answer.status_code == 404, answer.text
                assert answer.json()["error"]["param"] == "response_id"
            assert all(f"/v1/responses/{rid}" in w.reads for w in f.workers)  # its pool was asked


async def test_a_down_worker_of_its_own_pool_still_cannot_tell() -> None:
    async with fleet(2) as f:
        rid = await _stored(f)
        async with _with_a_dead_embeddings_pool(f) as gw:
            pool = gw.state.registry.pools["p"]
            pool.set_urls([*(w.url for w in f.workers), f"http://127.0.0.1:{free_port()}"])
            for answer in await _asked(gw.client, rid):
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "worker_unavailable"


async def test_an_id_naming_no_pool_is_looked_for_in_every_pool() -> None:
    """An id minted without a scope (before ids had one), or for a model no longer served: the
    down embeddings worker may be the one, so the search cannot say "not found"."""
    async with fleet(2) as f, _with_a_dead_embeddings_pool(f) as gw:
        ids = gw.state.gate.responses.ids
        for rid in (ids.mint("t"), ids.mint("t", "conv-1", model="gone")):
            for answer in await _asked(gw.client, rid):
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "worker_unavailable"


async def test_another_tenants_id_is_a_404_that_reaches_no_worker() -> None:
    async with fleet(2) as f:
        rid = await _stored(f)
        async with _with_a_dead_embeddings_pool(f) as gw:
            for answer in await _asked(gw.client, rid, OTHER):
                assert answer.status_code == 404, answer.text
            assert not any(w.reads for w in f.workers)
