"""Responses state: a follow-up reaches the worker holding its `previous_response_id` (learned from
whole and streamed answers), ids belong to their tenant, a gone or unroutable holder is never
silently replaced, the map is bounded and forgets."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from gateway.responses_affinity import ResponseAffinity
from policies.base import WorkerId
from tests.gateway.routes_rig import KEY, Rig, routes_rig

OTHER = {"authorization": "Bearer sk-other"}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig() as rig:
        yield rig


def _served_by(rig: Rig) -> str:
    return next(w.name for w in rig.workers if w.received and w.received[-1].seq == rig.last().seq)


async def _create(rig: Rig, stream: bool = False, **extra: object) -> str:
    body = {"model": "m", "instructions": "Be brief. " * 10, "input": "first", "stream": stream, **extra}
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 200
    if stream:
        created = resp.content.split(b"\n\n", 1)[0]
        return created.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    rid: str = resp.json()["id"]
    return rid


@pytest.mark.parametrize("stream", [False, True])
async def test_follow_ups_reach_the_worker_holding_the_response(rig: Rig, stream: bool) -> None:
    rid = await _create(rig, stream)
    holder = _served_by(rig)
    for n in range(4):  # round_robin alone would alternate between the two workers
        body = {"model": "m", "input": f"turn {n}", "previous_response_id": rid, "stream": stream}
        resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
        assert resp.status_code == 200
        assert _served_by(rig) == holder and rig.last().json()["previous_response_id"] == rid
        rid = (
            resp.json()["id"]
            if not stream
            else resp.content.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
        )
    assert len(rig.state.gate.responses) == 5
    resp = await rig.client.get(f"/v1/responses/{rid}", headers=KEY)
    assert resp.status_code == 200 and resp.json()["id"] == rid and _served_by(rig) == holder
    resp = await rig.client.post(f"/v1/responses/{rid}/cancel", headers=KEY)
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "cannot cancel"


async def test_another_tenants_response_is_never_reached(rig: Rig) -> None:
    rid = await _create(rig)
    before = sum(len(w.received) for w in rig.workers)
    body = {"model": "m", "input": "peek", "previous_response_id": rid}
    resp = await rig.client.post("/v1/responses", json=body, headers=OTHER)
    assert (
        resp.status_code == 404 and resp.json()["error"]["message"] == f"Response with id '{rid}' not found."
    )
    assert (await rig.client.get(f"/v1/responses/{rid}", headers=OTHER)).status_code == 404
    assert (await rig.client.post(f"/v1/responses/{rid}/cancel", headers=OTHER)).status_code == 404
    # Nor may it take the id for its own next response (vLLM would overwrite the stored one).
    resp = await rig.client.post(
        "/v1/responses", json={"model": "m", "input": "x", "request_id": rid}, headers=OTHER
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_id"
    assert sum(len(w.received) for w in rig.workers) == before
    # An id the gateway never saw reads the same as another tenant's (nothing tells them apart).
    unknown = (await rig.client.get("/v1/responses/resp_unknown", headers=OTHER)).json()["error"]
    foreign = (await rig.client.get(f"/v1/responses/{rid}", headers=OTHER)).json()["error"]
    assert unknown == {**foreign, "message": "Response with id 'resp_unknown' not found."}


async def test_an_unroutable_holder_is_a_503_and_a_gone_one_a_404(rig: Rig) -> None:
    rid = await _create(rig)
    holder = next(w for w in rig.workers if w.name == _served_by(rig))
    pool = rig.state.registry.pools["p"]
    before = {w.name: len(w.received) for w in rig.workers}
    pool.workers[WorkerId(holder.url)].healthy = False
    body = {"model": "m", "input": "next", "previous_response_id": rid}
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert {w.name: len(w.received) for w in rig.workers} == before  # no silent re-route
    pool.set_urls([w.url for w in rig.workers if w is not holder])
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "previous_response_id"


async def test_unknown_and_unstored_ids_are_routed_by_the_policy(rig: Rig) -> None:
    rid = await _create(rig, store=False)
    assert len(rig.state.gate.responses) == 0
    body = {"model": "m", "input": "next", "previous_response_id": rid}
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    # Neither worker stored it: the worker's own 404 comes back, in the gateway's error shape.
    assert resp.status_code == 404
    assert resp.json()["error"] == {
        "message": f"Response with id '{rid}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": None,
    }
    assert rig.policy.requests[-1].block_keys == ()  # keyed up to the instructions: there are none


def test_the_map_is_bounded_forgets_and_keeps_owners() -> None:
    affinity = ResponseAffinity(max_entries=3, ttl_s=10.0)
    w = WorkerId("http://w")
    for n in range(5):
        affinity.learn(f"r{n}", "t", "p", w, float(n))
    assert len(affinity) == 3 and affinity.holder("r0", 5.0) is None and affinity.holder("r1", 5.0) is None
    assert affinity.holder("r2", 5.0) is not None  # a use refreshes it: r3 is now the oldest
    affinity.learn("r5", "t", "p", w, 6.0)
    assert affinity.holder("r3", 6.0) is None and affinity.holder("r2", 6.0) is not None
    affinity.learn("r2", "intruder", "p", WorkerId("http://x"), 7.0)
    held = affinity.holder("r2", 7.0)
    assert held is not None and held.tenant == "t" and held.worker == w
    assert affinity.holder("r5", 17.5) is None  # expired 10 s after its last use
    affinity.check_invariants()


def test_random_use_keeps_the_invariants() -> None:
    rng = random.Random(7)
    affinity = ResponseAffinity(max_entries=50, ttl_s=30.0)
    now_s = 0.0
    for _ in range(5000):
        now_s += rng.random()
        rid = f"r{rng.randrange(200)}"
        if rng.random() < 0.5:
            affinity.learn(rid, rng.choice("ab"), "p", WorkerId("w"), now_s)
        else:
            held = affinity.holder(rid, now_s)
            assert held is None or held.used_s == now_s
        affinity.check_invariants()
