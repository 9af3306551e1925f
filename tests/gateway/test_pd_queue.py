"""Prefill/decode pools wait in the pool's queue as mixed pools do: through the gateway, a vLLM
pair whose decode worker is full (`queue_rig`, `pd=True`); and the queue alone, in front of stub
P/D pools, for what counts as full."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.pool_capacity import capacity
from gateway.queueing import PoolQueue
from gateway.registry import Pool
from tests.gateway.queue_rig import RigFactory, fill, queue_rigs, serve_all
from tests.support.wait import wait_until


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    async with queue_rigs() as build:
        yield build


async def test_a_request_waits_for_a_decode_slot_and_is_served_when_one_frees(make_rig: RigFactory) -> None:
    rig = await make_rig(pd=True)
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    late = rig.send("light", "late")
    await wait_until(lambda: rig.queue.waiting == 1)  # the prefill worker is free, the decode one not
    await rig.answer_one()
    assert (await hold).status_code == 200
    await wait_until(lambda: len(rig.arrivals) == 2)
    rig.gate.put_nowait(None)
    assert (await late).status_code == 200
    assert rig.order() == ["hold", "late"]
    assert "kv_transfer_params" in rig.arrivals[1]  # served as a pair, not alone
    metrics = rig.state.routing.metrics
    assert metrics.pd_requests.children[("p", "prefill")].value == 2
    assert metrics.pd_requests.children[("p", "decode")].value == 2
    assert metrics.queue_wait.children[("p", "light")].counts != [0] * 16
    assert metrics.pd_transfer_outcomes.children[("p", "ok")].value == 2
    assert sum(metrics.pd_ttft.children[("p", "prefill")].counts) == 2
    rig.queue.check_invariants()


async def test_tenants_take_fair_turns(make_rig: RigFactory) -> None:
    rig = await make_rig(pd=True)
    sends: list[tuple[str, str, dict[str, Any]]] = [("heavy", f"h{i}", {}) for i in range(4)]
    sends += [("light", f"l{i}", {}) for i in range(2)]
    tasks = await fill(rig, sends)
    await serve_all(rig, tasks)
    # As in a mixed pool (test_queueing_order): a prefill leg's freed slot hands no turn of its own.
    assert rig.order() == ["hold", "h0", "l0", "h1", "l1", "h2", "h3"]


async def test_the_queue_timeout_is_the_mixed_pools_error(make_rig: RigFactory) -> None:
    answers = []
    for pd in (False, True):
        rig = await make_rig(pd=pd, timeout_s=0.2)
        hold = rig.send("heavy", "hold")
        arrivals = rig.arrivals
        await wait_until(lambda: len(arrivals) == 1)  # noqa: B023 (awaited in this iteration)
        resp = await rig.send("light", "late")
        answers.append((resp.status_code, resp.headers.get("retry-after"), resp.json()["error"]))
        assert "x-should-retry" not in resp.headers
        assert rig.state.routing.metrics.queue_refusals.children[("p", "light", "timeout")].value == 1
        await rig.answer_one()
        assert (await hold).status_code == 200
    assert answers[0] == answers[1]
    assert answers[0][:2] == (503, "1") and answers[0][2]["code"] == "queue_timeout"


async def test_the_bounds_refuse_at_once(make_rig: RigFactory) -> None:
    rig = await make_rig(pd=True, max_per_tenant=1, max_requests=2)
    tasks = await fill(rig, [("heavy", "h0", {}), ("light", "l0", {})])
    resp = await rig.send("heavy", "h1")
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full"
    resp = await rig.send("vip", "v0")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_full"
    await serve_all(rig, tasks)


def _pool(protocol: str, mixed: bool = False) -> Pool:
    urls = {"prefill_workers": ["http://127.0.0.1:1"], "decode_workers": ["http://127.0.0.1:2"]}
    config = PoolConfig(
        name="p",
        models=["m"],
        workers=["http://127.0.0.1:3"] if mixed else [],
        max_in_flight_per_worker=1,
        pd={"protocol": protocol},
        **urls,
    )
    pool = Pool(config)
    for worker in pool.workers.values():
        worker.healthy = True
    return pool


def _take(pool: Pool, url: str) -> None:
    pool.workers[url].acquire(1, 0, 0.0)  # type: ignore[index]


@pytest.mark.parametrize(
    ("protocol", "full", "splittable", "expected"),
    [
        # vLLM: a decode worker also serves a request alone, so only a full decode side holds it back.
        ("vllm", ["http://127.0.0.1:2"], True, True),
        ("vllm", ["http://127.0.0.1:1"], True, False),
        # SGLang: its decode workers take only pairs: either side full, and no pair can start.
        ("sglang", ["http://127.0.0.1:1"], True, True),
        ("sglang", ["http://127.0.0.1:2"], True, True),
        ("sglang", [], True, False),
        # Without a mixed worker an unsplittable request has no route at all: 503 at once.
        ("sglang", ["http://127.0.0.1:1"], False, False),
    ],
)
def test_what_counts_as_full(protocol: str, full: list[str], splittable: bool, expected: bool) -> None:
    pool = _pool(protocol)
    for url in full:
        _take(pool, url)
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics())
    assert queue._saturated(time.monotonic(), splittable) is expected


def test_a_free_mixed_worker_is_a_route_for_any_request() -> None:
    pool = _pool("sglang", mixed=True)
    _take(pool, "http://127.0.0.1:1")
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics())
    assert pool.pd_router is not None
    assert capacity(pool, pool.pd_router.settings.roles, time.monotonic(), False) == (1, 1)
    _take(pool, "http://127.0.0.1:3")
    assert queue._saturated(time.monotonic(), False)
