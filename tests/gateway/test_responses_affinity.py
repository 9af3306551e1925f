"""Responses state: a follow-up reaches the worker holding its `previous_response_id` (learned from
whole and streamed answers), ids belong to their tenant (another tenant's reads as unknown, and is
never forwarded), a gone or unroutable holder is never silently replaced, the map is bounded in
ids, bytes and per tenant, and forgets."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.config.pool import PoolConfig
from gateway.errors import ApiError
from gateway.registry import Pool
from gateway.responses_affinity import ResponseAffinity
from gateway.responses_ids import MAX_REQUEST_ID_CHARS, MAX_RESPONSE_ID_CHARS, ResponseIds
from gateway.responses_search import find_holder
from gateway.worker import Worker
from policies.base import WorkerId
from tests.gateway.routes_rig import KEY, Rig, routes_rig

OTHER = {"authorization": "Bearer sk-other"}
IDS = ResponseIds(b"affinity-map-tests")


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
    assert sum(len(w.received) for w in rig.workers) == before
    # Taking the id as its own `request_id` names another response: the stem is tagged with the
    # asking tenant, so the stored one is never overwritten, and nothing tells that the id was taken.
    resp = await rig.client.post(
        "/v1/responses", json={"model": "m", "input": "x", "request_id": rid}, headers=OTHER
    )
    assert resp.status_code == 200 and resp.json()["id"].startswith(rid + "_")
    assert (await rig.client.get(f"/v1/responses/{rid}", headers=KEY)).json()["id"] == rid
    # An id the gateway never saw reads the same as another tenant's (nothing tells them apart).
    unknown = (await rig.client.get("/v1/responses/resp_unknown", headers=OTHER)).json()["error"]
    foreign = (await rig.client.get(f"/v1/responses/{rid}", headers=OTHER)).json()["error"]
    assert unknown == {**foreign, "message": "Response with id 'resp_unknown' not found."}


@pytest.mark.parametrize("stream", [False, True])
async def test_another_tenants_follow_up_reads_as_an_unknown_id(rig: Rig, stream: bool) -> None:
    rid = await _create(rig)
    answers = {}
    for name, previous in (("foreign", rid), ("unknown", "resp_" + "0" * 32)):
        body = {"model": "m", "input": "peek", "previous_response_id": previous, "stream": stream}
        resp = await rig.client.post("/v1/responses", json=body, headers=OTHER)
        error = resp.json()["error"]
        answers[name] = (resp.status_code, {**error, "message": error["message"].replace(previous, "ID")})
    # An id of its own that no worker holds is asked of each worker (none is sent the follow-up),
    # and the 404 reads the same as the gateway's for another tenant's or a made-up id.
    own = rig.state.gate.responses.ids.mint("other")
    before = sum(len(w.received) for w in rig.workers)
    body = {"model": "m", "input": "peek", "previous_response_id": own, "stream": stream}
    resp = await rig.client.post("/v1/responses", json=body, headers=OTHER)
    assert sum(len(w.received) for w in rig.workers) == before + len(rig.workers)
    error = resp.json()["error"]
    answers["own"] = (resp.status_code, {**error, "message": error["message"].replace(own, "ID")})
    assert answers["foreign"] == answers["unknown"] == answers["own"]
    assert answers["foreign"][0] == 404 and answers["foreign"][1]["param"] == "response_id"


async def test_a_long_or_odd_request_id_is_refused_and_never_remembered(rig: Rig) -> None:
    long_id = "resp_" + "x" * MAX_REQUEST_ID_CHARS
    for bad in (long_id, "resp one", "", 7):
        body = {"model": "m", "input": "x", "request_id": bad}
        resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_id", bad
    assert resp.status_code == 400
    long_resp = await rig.client.post(
        "/v1/responses", json={"model": "m", "input": "x", "request_id": long_id}, headers=KEY
    )
    assert long_resp.json()["error"]["code"] == "string_above_max_length"
    assert not any(w.received for w in rig.workers)
    ok = "resp_" + "y" * (MAX_REQUEST_ID_CHARS - 5)
    rid = await _create(rig, request_id=ok)
    assert rid.startswith(ok + "_") and len(rid) == MAX_RESPONSE_ID_CHARS
    assert rig.last().json()["request_id"] == rid and len(rig.state.gate.responses) == 1


async def test_a_long_id_learned_from_a_worker_is_not_remembered(rig: Rig) -> None:
    responses = rig.state.gate.responses
    responses.learn("resp_" + "z" * 2_000_000, "t", "p", WorkerId(rig.workers[0].url), 0.0)
    responses.learn("resp_with space", "t", "p", WorkerId(rig.workers[0].url), 0.0)
    assert len(responses) == 0
    rig.workers[0].response_id_suffix = "x"  # answers with ids other than the ones minted
    rig.workers[1].response_id_suffix = "x"
    await _create(rig)
    assert len(responses) == 0


async def test_one_tenants_burst_cannot_evict_anothers_share() -> None:
    # Three tenants share 6 ids: each is reserved 2.
    async with routes_rig(responses={"affinity_max_entries": 6}) as rig:
        holders = {}
        for _ in range(2):
            rid = await _create(rig)
            holders[rid] = _served_by(rig)
        for n in range(20):
            resp = await rig.client.post(
                "/v1/responses", json={"model": "m", "input": f"burst {n}"}, headers=OTHER
            )
            assert resp.status_code == 200
        assert rig.state.gate.responses.held_by("t") == 2
        asked = len(rig.policy.requests)
        for rid in holders:  # (not stored: a new id of t's own would evict its oldest)
            body = {"model": "m", "input": "next", "previous_response_id": rid, "store": False}
            resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
            assert resp.status_code == 200, resp.text
            assert _served_by(rig) == holders[rid]
        assert len(rig.policy.requests) == asked  # pinned: the policy was not asked
        rig.state.gate.responses.check_invariants()


async def test_an_unroutable_holder_is_a_503_and_a_gone_one_a_404(rig: Rig) -> None:
    rid = await _create(rig)
    holder = next(w for w in rig.workers if w.name == _served_by(rig))
    pool = rig.state.registry.pools["p"]
    before = {w.name: len(w.received) for w in rig.workers}
    pool.workers[WorkerId(holder.url)].healthy = False
    body = {"model": "m", "input": "next", "previous_response_id": rid}
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    # The pool's other worker is healthy: the message names what is missing, the conversation's worker.
    assert (error["code"], error["param"]) == ("no_worker_available", "previous_response_id")
    assert error["message"].startswith(
        "the worker holding the conversation (previous_response_id) is unavailable"
    )
    assert {w.name: len(w.received) for w in rig.workers} == before  # no silent re-route
    for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/cancel"):  # so do its own routes
        method = rig.client.get if path.endswith(rid) else rig.client.post
        resp = await method(path, headers=KEY)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
        assert resp.json()["error"]["code"] == "no_worker_available"
    assert {w.name: len(w.received) for w in rig.workers} == before
    pool.set_urls([w.url for w in rig.workers if w is not holder])
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"


async def test_a_holder_that_died_is_named_as_the_worker_holding_the_conversation(rig: Rig) -> None:
    """The holder's process is gone (connections refused): a 502 that says whose worker failed,
    not "could not reach a worker", and no other worker is tried."""
    rid = await _create(rig)
    index = next(i for i, w in enumerate(rig.workers) if w.name == _served_by(rig))
    await rig.runners[index].cleanup()  # its listener and open connections close
    body = {"model": "m", "input": "next", "previous_response_id": rid}
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    error = resp.json()["error"]
    assert (resp.status_code, error["code"], error["param"]) == (502, "bad_gateway", "previous_response_id")
    assert error["message"] == (
        "the worker holding the conversation (previous_response_id) is unavailable: "
        "could not reach a worker (connect failed)"
    )
    resp = await rig.client.get(f"/v1/responses/{rid}", headers=KEY)
    assert resp.status_code == 502
    assert resp.json()["error"]["message"] == "could not reach the worker holding the response"


async def test_an_id_no_worker_stored_is_looked_for_and_is_vllms_404(rig: Rig) -> None:
    rid = await _create(rig, store=False)
    assert len(rig.state.gate.responses) == 0
    before = [len(w.received) for w in rig.workers]
    body = {"model": "m", "input": "next", "previous_response_id": rid}
    resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
    # Each worker was asked for it (and neither stored it); none got the follow-up. The answer is
    # vLLM's 404, in the gateway's error shape.
    asked = [w.received[n:] for w, n in zip(rig.workers, before, strict=True)]
    assert [[got.path for got in new] for new in asked] == [[f"/v1/responses/{rid}"]] * len(rig.workers)
    assert resp.status_code == 404
    assert resp.json()["error"] == {
        "message": f"Response with id '{rid}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": None,
    }


async def test_the_holder_search_asks_healthy_workers_in_order_and_stops_at_the_first_holder() -> None:
    pools = [
        Pool(PoolConfig(name="a", models=["m"], workers=["http://a1:1", "http://a2:1", "http://a3:1"])),
        Pool(PoolConfig(name="b", models=["n"], workers=["http://b1:1", "http://b2:1", "http://b3:1"])),
    ]
    for pool in pools:
        for worker in pool.workers.values():
            worker.healthy = worker.url != "http://a1:1"
    # Unreachable, timed out, not holding it, holding it; b3 is never asked.
    answers: dict[str, object] = {
        "http://a2:1": aiohttp.ClientConnectionError("refused"),
        "http://a3:1": TimeoutError(),
        "http://b1:1": None,
        "http://b2:1": "b2's answer",
        "http://b3:1": "b3's answer",
    }
    asked: list[str] = []

    async def ask(pool: Pool, worker: Worker) -> str | None:
        asked.append(worker.url)
        answer = answers[worker.url]
        if isinstance(answer, BaseException):
            raise answer
        assert answer is None or isinstance(answer, str)
        return answer

    found = await find_holder(pools, ask)
    assert asked == ["http://a2:1", "http://a3:1", "http://b1:1", "http://b2:1"]
    assert found is not None
    assert (found.pool.name, found.worker.url, found.answer) == ("b", "http://b2:1", "b2's answer")
    # No worker holds it: every healthy one was asked. Three could not tell (unhealthy,
    # unreachable, timed out): not proof that it does not exist, a 503 the client may retry.
    answers["http://b2:1"] = answers["http://b3:1"] = None
    asked.clear()
    with pytest.raises(ApiError) as undecided:
        await find_holder(pools, ask)
    assert (undecided.value.status, undecided.value.code) == (503, "worker_unavailable")
    assert len(asked) == 5
    # Every worker says it does not hold it: None (the gateway's 404).
    for pool in pools:
        for worker in pool.workers.values():
            worker.healthy = True
            answers[worker.url] = None
    asked.clear()
    assert await find_holder(pools, ask) is None
    assert len(asked) == 6
    # A failure that is not the worker's (a gateway bug) ends the search.
    answers["http://a2:1"] = ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        await find_holder(pools, ask)


def test_the_map_is_bounded_forgets_and_keeps_owners() -> None:
    affinity = ResponseAffinity(max_entries=3, ttl_s=10.0, ids=IDS)
    w = WorkerId("http://w")
    for n in range(5):
        affinity.learn(f"r{n}", "t", "p", w, float(n))
    assert len(affinity) == 3 and affinity.holder("r0", "t", 5.0) is None
    assert affinity.holder("r1", "t", 5.0) is None
    assert affinity.holder("r2", "t", 5.0) is not None  # a use refreshes it: r3 is now the oldest
    affinity.learn("r5", "t", "p", w, 6.0)
    assert affinity.holder("r3", "t", 6.0) is None and affinity.holder("r2", "t", 6.0) is not None
    affinity.learn("r2", "intruder", "p", WorkerId("http://x"), 7.0)
    assert affinity.holder("r2", "intruder", 7.0) is None
    held = affinity.holder("r2", "t", 7.0)
    assert held is not None and held.tenant == "t" and held.worker == w
    assert affinity.holder("r5", "t", 17.5) is None  # expired 10 s after its last use
    affinity.check_invariants()


def test_another_tenants_probe_does_not_keep_an_id_alive() -> None:
    affinity = ResponseAffinity(max_entries=4, ttl_s=10.0, tenants=2, ids=IDS)
    w = WorkerId("http://w")
    affinity.learn("a", "alice", "p", w, 0.0)
    assert affinity.holder("a", "bob", 9.0) is None
    assert affinity.holder("a", "alice", 10.5) is None  # bob's probe at 9 s did not refresh it
    # Nor does a probe move it in alice's least-recently-used order.
    affinity.learn("a1", "alice", "p", w, 11.0)
    affinity.learn("a2", "alice", "p", w, 12.0)
    affinity.learn("a3", "alice", "p", w, 13.0)
    affinity.learn("b1", "bob", "p", w, 13.0)
    assert affinity.holder("a1", "bob", 14.0) is None
    affinity.learn("a4", "alice", "p", w, 15.0)  # full, alice above her reserve of 2: her oldest goes
    assert affinity.holder("a1", "alice", 15.0) is None and affinity.holder("a2", "alice", 15.0) is not None
    affinity.check_invariants()


def test_a_tenant_within_its_reserve_is_never_evicted_by_another() -> None:
    affinity = ResponseAffinity(max_entries=9, ttl_s=1e9, tenants=3, ids=IDS)  # 3 ids reserved each
    w = WorkerId("http://w")
    for n in range(3):
        affinity.learn(f"a{n}", "alice", "p", w, float(n))
    for n in range(4):
        affinity.learn(f"c{n}", "carol", "p", w, float(n))
    for n in range(50):  # bob bursts: the map fills, then bob and carol (above 3) pay
        affinity.learn(f"b{n}", "bob", "p", w, 10.0 + n)
        affinity.check_invariants()
    assert all(affinity.holder(f"a{n}", "alice", 100.0) is not None for n in range(3))
    assert affinity.held_by("carol") == 3 and affinity.held_by("bob") == 3
    # While alice is idle, her reserve is usable by the others.
    lone = ResponseAffinity(max_entries=9, ttl_s=1e9, tenants=3, ids=IDS)
    for n in range(9):
        lone.learn(f"b{n}", "bob", "p", w, float(n))
    assert len(lone) == 9


def test_a_quiet_tenants_expired_ids_do_not_keep_its_reserve() -> None:
    affinity = ResponseAffinity(max_entries=4, ttl_s=60.0, tenants=2, ids=IDS)  # 2 ids reserved each
    w = WorkerId("http://w")
    for n in range(2):
        affinity.learn(f"a{n}", "alice", "p", w, float(n))
    for n in range(4):  # a day later alice is gone: bob's ids take her expired places
        affinity.learn(f"b{n}", "bob", "p", w, 86_400.0 + n)
        affinity.check_invariants()
    assert affinity.held_by("alice") == 0 and affinity.held_by("bob") == 4
    assert all(affinity.holder(f"b{n}", "bob", 86_410.0) is not None for n in range(4))


def test_random_use_keeps_the_invariants() -> None:
    rng = random.Random(7)
    affinity = ResponseAffinity(max_entries=50, ttl_s=30.0, tenants=3, ids=IDS)
    now_s = 0.0
    for _ in range(5000):
        now_s += rng.random()
        rid = f"r{rng.randrange(200)}"
        tenant = rng.choice("abcd")  # one more tenant than the reserve was divided among
        if rng.random() < 0.5:
            affinity.learn(rid, tenant, "p", WorkerId("w"), now_s)
        else:
            held = affinity.holder(rid, tenant, now_s)
            assert held is None or (held.used_s == now_s and held.tenant == tenant)
        affinity.check_invariants()
