"""A Responses request that a prefill/decode pool sends again after a failed round names a new
response there, both legs of a round naming the same one.

vLLM and SGLang name the response a request creates after the body's `request_id`, and a worker
that failed a request may have stored its response all the same (the gateway saw a dropped
connection). Before, every round of a split reused the first round's id, so a retried pair's
decode worker stored a second response under the id the first round's decode worker already held:
two workers held one id, and a gateway process that did not know the id could find the wrong one.
SGLang's two legs of one round are one request to its engine, so they keep one id (the prefill
leg with `store: false`). A Responses request in a vLLM pool runs alone, and each attempt already
named a new id: the vLLM test guards that.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from tests.gateway.responses_store import responses_app
from tests.gateway.routes_rig import Recording
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_in

SECRET = b"pd-retry-ids"
KEY = {"authorization": "Bearer sk-t"}
ROLES = ("p1", "p2", "d1", "d2")


@dataclass
class Fleet:
    """Two prefill and two decode workers that store every response asked to be stored, before
    answering. `fault` fails the first request of one role: "decode_drop" (the decode worker
    stores the response, then drops the connection before answering) or "prefill_500" (the prefill
    worker answers 500; the decode leg of its SGLang room then gets no KV and answers 500)."""

    fault: str
    failed: list[str] = field(default_factory=list)  # the worker that failed, once it has
    posts: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {n: [] for n in ROLES})
    stored: dict[str, dict[str, dict[str, Any]]] = field(default_factory=lambda: {n: {} for n in ROLES})
    rooms: dict[int, asyncio.Future[bool]] = field(default_factory=dict)  # SGLang: did the KV come

    def room(self, body: dict[str, Any]) -> asyncio.Future[bool] | None:
        number = body.get("bootstrap_room")
        if not isinstance(number, int):
            return None
        return self.rooms.setdefault(number, asyncio.get_running_loop().create_future())

    def _fails(self, name: str) -> bool:
        role = "prefill" if self.fault.startswith("prefill") else "decode"
        if self.failed or not name.startswith(role[0]):
            return False
        self.failed.append(name)
        return True

    def app(self, name: str) -> web.Application:
        async def create(request: web.Request) -> web.StreamResponse:
            body = orjson.loads(await request.read())
            self.posts[name].append(body)
            room = self.room(body)
            rid = body["request_id"]
            usage = {"input_tokens": 8, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 0}}
            answer = {"id": rid, "object": "response", "status": "completed", "output": [],
                      "usage": usage, "served_by": name}  # fmt: skip
            if name.startswith("p"):
                failing = self._fails(name)
                if room is not None and not room.done():
                    room.set_result(not failing)
                if failing:
                    return _error("engine died")
            elif room is not None and not await asyncio.wait_for(asyncio.shield(room), 10):
                return _error("KV transfer failed")
            if body.get("store") is not False:
                self.stored[name][rid] = answer
            if name.startswith("d") and self._fails(name) and self.fault == "decode_drop":
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            return web.json_response(answer)

        return responses_app(create, self.stored[name])

    def holders(self, rid: str) -> list[str]:
        return [name for name in ROLES if rid in self.stored[name]]


def _error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": 500}}, status=500)


@contextlib.asynccontextmanager
async def fleet_of(fault: str) -> AsyncIterator[tuple[Fleet, dict[str, str]]]:
    fleet = Fleet(fault)
    async with contextlib.AsyncExitStack() as stack:
        urls = {name: await serve_in(stack, fleet.app(name)) for name in ROLES}
        yield fleet, urls


@contextlib.asynccontextmanager
async def gateway(urls: dict[str, str], protocol: str) -> AsyncIterator[httpx.AsyncClient]:
    pd: dict[str, Any] = {"protocol": protocol, "conditional": False}  # a pair whenever one is free
    if protocol == "sglang":
        pd["bootstrap_port"] = 8998
    config = {
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "prefill_workers": [urls["p1"], urls["p2"]],
                "decode_workers": [urls["d1"], urls["d2"]],
                "pd": pd,
                "retry_attempts": 2,
            }
        ],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
        "scrape": {"enabled": False},
    }
    async with gateway_in_process(config, Recording(), secret=SECRET) as gw:
        yield gw.client


@pytest.mark.parametrize("fault", ["decode_drop", "prefill_500"])
async def test_each_round_of_an_sglang_split_names_a_new_response_on_both_legs(fault: str) -> None:
    async with fleet_of(fault) as (fleet, urls):
        async with gateway(urls, "sglang") as client:
            resp = await client.post("/v1/responses", json={"model": "m", "input": "hello"}, headers=KEY)
            assert resp.status_code == 200, resp.text
        rid = resp.json()["id"]
        assert fleet.failed
        # Each round's legs share a bootstrap room and name one response; no two rounds name one.
        rounds: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for name in ROLES:
            for body in fleet.posts[name]:
                rounds.setdefault(body["bootstrap_room"], []).append((name, body))
        assert len(rounds) == 2, "one failed round, then one that answered"
        ids = []
        for legs in rounds.values():
            assert sorted(name[0] for name, _ in legs) == ["d", "p"]
            (named,) = {body["request_id"] for _, body in legs}
            assert [body.get("store") for name, body in legs if name.startswith("p")] == [False]
            ids.append(named)
        assert len(set(ids)) == 2
        # The client's response is the answering round's, and only its decode worker holds it.
        assert rid in ids
        (holder,) = fleet.holders(rid)
        assert holder.startswith("d") and holder != fleet.failed[0]
        if fault == "decode_drop":
            (lost,) = fleet.holders(next(i for i in ids if i != rid))
            assert lost == fleet.failed[0], "the failed decode worker stored the first round's response"
        # A gateway process that does not know the id finds the client's response.
        async with gateway(urls, "sglang") as another:
            got = await another.get(f"/v1/responses/{rid}", headers=KEY)
            assert got.status_code == 200 and got.json()["served_by"] == holder


async def test_a_retried_responses_request_in_a_vllm_pool_names_a_new_response() -> None:
    """vLLM's Responses route carries no KV transfer: the request runs alone on a decode worker,
    and its retry after a dropped connection on another, with an id of its own."""
    async with fleet_of("decode_drop") as (fleet, urls):
        async with gateway(urls, "vllm") as client:
            resp = await client.post("/v1/responses", json={"model": "m", "input": "hello"}, headers=KEY)
            assert resp.status_code == 200, resp.text
        rid = resp.json()["id"]
        assert fleet.posts["p1"] == fleet.posts["p2"] == []
        (failed,) = fleet.failed
        answered = "d2" if failed == "d1" else "d1"
        (first,), (second,) = fleet.posts[failed], fleet.posts[answered]
        assert first["request_id"] != second["request_id"] == rid
        assert fleet.holders(rid) == [answered]
        assert fleet.holders(first["request_id"]) == [failed]
