"""Every way out of a pool's queue records the wait: the access line's `queue_ms` and
`kvgate_queue_wait_seconds` (by the request's tenant), not only a waiter that was served, so the
longest waits (those that time out under saturation) are in the percentiles."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.failure import Failure
from gateway.metrics import GatewayMetrics
from gateway.queueing import PoolQueue
from gateway.registry import Pool
from gateway.worker import Worker
from tests.gateway.access_lines import capture_access
from tests.gateway.queue_rig import RigFactory, queue_rigs
from tests.gateway.test_queueing import FirstFree, _queued, full_pool  # noqa: F401
from tests.support.leaving_client import leaving_chat
from tests.support.wait import wait_until


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    async with queue_rigs() as build:
        yield build


def _waits(metrics: GatewayMetrics, tenant: str) -> tuple[float, float]:
    """`kvgate_queue_wait_seconds` of pool p and `tenant`: (count, sum)."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.labels == {"pool": "p", "tenant": tenant}:
                found[s.name] = s.value
    return found.get("kvgate_queue_wait_seconds_count", 0.0), found.get("kvgate_queue_wait_seconds_sum", 0.0)


async def test_a_queue_timeout_logs_and_observes_its_wait(make_rig: RigFactory) -> None:
    rig = await make_rig(timeout_s=0.2)
    lines = capture_access(rig.state)
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    resp = await rig.send("light", "late")
    assert resp.json()["error"]["code"] == "queue_timeout"
    line = lines.of(resp.headers["x-request-id"])
    assert line["queue_ms"] is not None and line["queue_ms"] >= 200
    count, total_s = _waits(rig.state.routing.metrics, "light")
    assert count == 1 and total_s >= 0.2
    await rig.answer_one()
    assert (await hold).status_code == 200


async def test_a_waiter_whose_client_leaves_logs_and_observes_its_wait(make_rig: RigFactory) -> None:
    rig = await make_rig()
    lines = capture_access(rig.state)
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    sent: list[MutableMapping[str, Any]] = []
    gone, leave = leaving_chat(rig.app, "sk-light", "gone", sent)
    await wait_until(lambda: rig.queue.waiting == 1)
    leave.set()
    await wait_until(gone.done)
    lines.flush()
    (line,) = (r for r in lines.records if r["status"] == 499)
    assert line["queue_ms"] is not None
    assert _waits(rig.state.routing.metrics, "light")[0] == 1
    await rig.answer_one()
    assert (await hold).status_code == 200


async def test_waiters_closed_by_the_drain_or_left_without_a_worker_have_their_wait(
    full_pool: tuple[Pool, Worker],  # noqa: F811
) -> None:
    pool, worker = full_pool
    metrics = GatewayMetrics()
    queue = PoolQueue(pool, pool.config.queue, {}, metrics, tick_s=0.01)
    closed, orphan = _queued("a"), _queued("b")
    policy = FirstFree()
    stuck = asyncio.ensure_future(queue.wait(closed, lambda: policy))
    await wait_until(lambda: queue.waiting == 1)
    queue.close()
    refused = await stuck
    assert isinstance(refused, Failure) and refused.code == "gateway_shutting_down"
    assert closed.queued_s is not None and _waits(metrics, "a")[0] == 1
    waiting = asyncio.ensure_future(queue.wait(orphan, lambda: policy))
    await wait_until(lambda: queue.waiting == 1)
    worker.healthy = False
    routed = await asyncio.wait_for(waiting, 2)
    assert isinstance(routed, tuple) and routed[0] is None
    assert orphan.queued_s is not None and _waits(metrics, "b")[0] == 1
    queue.check_invariants()
