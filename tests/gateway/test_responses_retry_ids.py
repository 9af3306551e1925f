"""A `POST /v1/responses` the gateway retries on another worker names a new response there.

vLLM names the response after the body's `request_id`, and a worker that fails the request (a
500, a dropped connection) may have stored it all the same. Before, the retry sent the same
minted id, so two workers held one id; now each attempt sends an id of its own, the client gets
the answering worker's, and a follow-up naming it reaches that worker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.responses_affinity import (
    ResponseAffinity,
    mint_response_id,
    with_new_response_id,
    with_response_id,
)
from gateway.responses_ids import ResponseIds
from policies import make_policy
from tests.gateway.responses_store import responses_app
from tests.gateway.routes_rig import KEY, SECRET, config
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_app


@dataclass
class Fleet:
    """Two workers that store every response they are asked for; the first `POST` of all (to
    whichever worker gets it) then fails by `fault`, every later one is answered."""

    fault: str
    failed: list[str] = field(default_factory=list)  # the worker that failed, once it has
    stored: dict[str, dict[str, Any]] = field(default_factory=lambda: {"w1": {}, "w2": {}})
    posts: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"w1": [], "w2": []})

    def app(self, name: str) -> web.Application:
        async def create(request: web.Request) -> web.StreamResponse:
            body = orjson.loads(await request.read())
            self.posts[name].append(body)
            previous = body.get("previous_response_id")
            if previous is not None and previous not in self.stored[name]:
                error = {"message": f"Response with id '{previous}' not found.", "code": 404}
                return web.json_response({"error": error}, status=404)
            rid = body["request_id"]
            answer = {"id": rid, "object": "response", "status": "completed", "output": [],
                      "usage": {"input_tokens": 4, "output_tokens": 1}}  # fmt: skip
            self.stored[name][rid] = answer  # stored before the answer is sent, as vLLM does
            if not self.failed:
                self.failed.append(name)
                if self.fault == "drop":
                    assert request.transport is not None
                    request.transport.close()
                    return web.Response()
                return web.json_response({"error": {"message": "engine died", "code": 500}}, status=500)
            return web.json_response(answer)

        return responses_app(create, self.stored[name])


@dataclass
class Rig:
    gw: InProcessGateway
    fleet: Fleet
    urls: dict[str, str]


@pytest.fixture(params=["500", "drop"])
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    fleet = Fleet(request.param)
    runners, urls = [], {}
    try:
        for name in ("w1", "w2"):
            runner, port = await serve_app(fleet.app(name))
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{port}"
        built = config(list(urls.values()), {"retry_attempts": 1})
        async with gateway_in_process(built, make_policy("round_robin"), secret=SECRET) as gw:
            yield Rig(gw, fleet, urls)
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("own_request_id", [None, "conv-7"])
async def test_a_retried_response_is_named_anew_and_followed_up_where_it_was_answered(
    rig: Rig, own_request_id: str | None
) -> None:
    body: dict[str, Any] = {"model": "m", "input": "hello"}
    if own_request_id is not None:
        body["request_id"] = own_request_id
    resp = await rig.gw.client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 200, resp.text
    fleet = rig.fleet
    (failed,) = fleet.failed
    answered = "w2" if failed == "w1" else "w1"
    (first,) = fleet.posts[failed]
    (second,) = fleet.posts[answered]
    # Each worker was asked for a response of its own id, both the tenant's.
    assert first["request_id"] != second["request_id"]
    ids = rig.gw.state.gate.responses
    assert ids is not None
    assert ids.ids.owned_by(first["request_id"], "t") and ids.ids.owned_by(second["request_id"], "t")
    if own_request_id is not None:
        assert first["request_id"].startswith("conv-7_") and second["request_id"].startswith("conv-7_")
    # The client has the answering worker's response, which no other worker holds.
    rid = resp.json()["id"]
    assert rid == second["request_id"]
    assert rid in fleet.stored[answered] and rid not in fleet.stored[failed]
    # Its follow-up goes where it is.
    follow = await rig.gw.client.post(
        "/v1/responses", json={"model": "m", "input": "more", "previous_response_id": rid}, headers=KEY
    )
    assert follow.status_code == 200, follow.text
    assert [p.get("previous_response_id") for p in fleet.posts[answered]] == [None, rid]
    assert len(fleet.posts[failed]) == 1


@pytest.mark.parametrize("own_request_id", [None, "conv-7"])
def test_a_new_id_replaces_the_old_in_the_body_and_its_encoding(own_request_id: str | None) -> None:
    affinity = ResponseAffinity(max_entries=8, ttl_s=60.0, ids=ResponseIds(b"k" * 32))
    client: dict[str, Any] = {"model": "m", "input": 'say "request_id":"x"', "metadata": {"request_id": "y"}}
    if own_request_id is not None:
        client["request_id"] = own_request_id
    first = mint_response_id(affinity, client, "t")
    body, encoded = with_response_id(client, orjson.dumps(client), first)
    renamed, renamed_encoded = with_new_response_id(affinity, body, encoded, "t", own_request_id)
    assert renamed["request_id"] != first and affinity.ids.owned_by(renamed["request_id"], "t")
    assert orjson.loads(renamed_encoded) == renamed == {**client, "request_id": renamed["request_id"]}
