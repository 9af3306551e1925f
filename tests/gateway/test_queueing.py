"""The pool queue alone, in front of a stub pool whose one worker is full: turns handed to waiters
that left or lost a race, workers that go, the fast path, and the drain deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast
from unittest.mock import ANY

import pytest

from gateway.admitted import Admitted
from gateway.config.pool import PoolConfig
from gateway.failure import Failure
from gateway.metrics import GatewayMetrics
from gateway.queueing import PoolQueue
from gateway.registry import Pool
from gateway.worker import Worker
from policies.base import RouteDecision, RouteRequest, WorkerView
from tests.support.policies import IgnoresFeedback
from tests.support.wait import wait_until


class FirstFree(IgnoresFeedback):
    """Picks the first healthy worker below its cap."""

    name = "first_free"

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        for w in workers:
            if w.healthy and (w.max_in_flight is None or w.in_flight_requests < w.max_in_flight):
                return RouteDecision(w.worker_id, 0.0, "first")
        return None


@dataclass
class _Request:
    """The parts of an admitted request the queue reads and writes."""

    tenant: Any
    route: RouteRequest
    priority: int = 0
    queued_s: float | None = None


def _queued(tenant: str) -> Admitted:
    route = RouteRequest(
        request_id=tenant,
        pool="p",
        tenant=tenant,
        namespace="",
        block_keys=(),
        n_prompt_tokens=1,
        block_size_tokens=16,
    )
    return cast(Admitted, _Request(SimpleNamespace(name=tenant), route))


@pytest.fixture
def full_pool() -> tuple[Pool, Worker]:
    pool = Pool(
        PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9"], max_in_flight_per_worker=1)
    )
    (worker,) = pool.workers.values()
    worker.healthy = True
    worker.acquire(1, 0, 0.0)  # its one slot is taken
    return pool, worker


def _free(pool: Pool, worker: Worker, queue: PoolQueue) -> None:
    worker.release(1, 0, prefill_done=True)
    queue.slot_freed()


async def test_a_turn_handed_to_a_waiter_that_left_goes_to_the_next(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    policy = FirstFree()
    first = asyncio.ensure_future(queue.wait(_queued("a"), lambda: policy))
    second = asyncio.ensure_future(queue.wait(_queued("b"), lambda: policy))
    await wait_until(lambda: queue.waiting == 2)
    _free(pool, worker, queue)  # the turn goes to "a" ...
    first.cancel()  # ... whose client leaves before its task runs
    routed = await asyncio.wait_for(second, 2)
    assert isinstance(routed, tuple) and routed[0] is not None
    assert first.cancelled() and queue.waiting == 0 and queue._turns == 0
    queue.check_invariants()


async def test_waiters_get_no_worker_when_the_last_routable_worker_goes(
    full_pool: tuple[Pool, Worker],
) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    waiters = [asyncio.ensure_future(queue.wait(_queued(t), FirstFree)) for t in ("a", "b")]
    await wait_until(lambda: queue.waiting == 2)
    worker.healthy = False
    results = await asyncio.wait_for(asyncio.gather(*waiters), 2)
    assert [r[0] for r in results if isinstance(r, tuple)] == [None, None]  # the caller answers 503
    queue.check_invariants()


async def test_a_turn_lost_to_a_race_keeps_its_place(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    policy = FirstFree()
    waiter = asyncio.ensure_future(queue.wait(_queued("a"), lambda: policy))
    await wait_until(lambda: queue.waiting == 1)
    _free(pool, worker, queue)
    worker.acquire(1, 0, 0.0)  # a retry elsewhere takes the slot before the waiter runs
    await wait_until(lambda: queue.waiting == 1 and queue._turns == 0)
    assert not waiter.done()
    _free(pool, worker, queue)
    routed = await asyncio.wait_for(waiter, 2)
    assert isinstance(routed, tuple) and routed[0] is not None
    queue.check_invariants()


async def test_a_waiter_is_routed_by_the_policy_running_when_its_turn_comes(
    full_pool: tuple[Pool, Worker],
) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    running: list[FirstFree] = [FirstFree()]
    waiter = asyncio.ensure_future(queue.wait(_queued("a"), lambda: running[0]))
    await wait_until(lambda: queue.waiting == 1)

    class Reloaded(FirstFree):
        def select(self, req: RouteRequest, views: Sequence[WorkerView], now: float) -> RouteDecision | None:
            decision = super().select(req, views, now)
            return None if decision is None else dataclasses.replace(decision, reason="reloaded")

    running[0] = Reloaded()  # a policy reload while the request waits
    _free(pool, worker, queue)
    routed = await asyncio.wait_for(waiter, 2)
    assert isinstance(routed, tuple) and routed[0] is not None and routed[0].reason == "reloaded"
    queue.check_invariants()


def _one_worker_pool(name: str) -> Pool:
    return Pool(
        PoolConfig(name=name, models=["m"], workers=["http://127.0.0.1:9"], max_in_flight_per_worker=1)
    )


async def test_a_request_waits_for_a_worker_being_added_and_fails_when_it_turns_out_down() -> None:
    # A pool whose workers were all just swapped (a workers file, DNS): the new one's first health
    # check is under way. Its capacity is about to come: wait for it, not 503.
    pool = Pool(
        PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9"], max_in_flight_per_worker=1)
    )
    (worker,) = pool.workers.values()
    assert worker.coming(time.monotonic()) and not worker.healthy
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    assert queue.try_route(_queued("a"), FirstFree()) is None  # not a 503: it must wait
    waiter = asyncio.ensure_future(queue.wait(_queued("a"), FirstFree))
    await wait_until(lambda: queue.waiting == 1)
    assert worker.record_health(True, pool.config) is not None  # up: the tick hands it a turn
    routed = await asyncio.wait_for(waiter, 2)
    assert isinstance(routed, tuple) and routed[0] is not None and routed[0].worker == worker.worker_id
    queue.check_invariants()

    fresh = Pool(
        PoolConfig(name="q", models=["m"], workers=["http://127.0.0.1:9"], max_in_flight_per_worker=1)
    )
    (other,) = fresh.workers.values()
    queue = PoolQueue(fresh, fresh.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    waiter = asyncio.ensure_future(queue.wait(_queued("a"), FirstFree))
    await wait_until(lambda: queue.waiting == 1)
    other.record_health(False, fresh.config)  # its first check failed: an outage, not waited out
    assert not other.coming(time.monotonic())
    routed = await asyncio.wait_for(waiter, 2)
    assert isinstance(routed, tuple) and routed[0] is None  # the caller answers 503
    assert queue.try_route(_queued("b"), FirstFree()) == (None, ANY)
    queue.check_invariants()

    # Nor is a worker whose first checks' time is over without a verdict (a hung check).
    config = PoolConfig(
        name="r", models=["m"], workers=["http://127.0.0.1:9"], health={"interval_s": 2, "timeout_s": 1}
    )
    (hung,) = Pool(config).workers.values()
    now_s = time.monotonic()
    assert hung.coming(now_s) and not hung.coming(now_s + 3.01)


def test_try_route_is_the_whole_path_when_nobody_waits(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics())
    assert queue.try_route(_queued("a"), FirstFree()) is None  # full: it must wait
    worker.release(1, 0, prefill_done=True)
    routed = queue.try_route(_queued("a"), FirstFree())
    assert routed is not None and routed[0] is not None
    worker.healthy = False
    routed = queue.try_route(_queued("a"), FirstFree())
    assert routed is not None and routed[0] is None  # no worker at all: 503 at once, no waiting


async def test_at_the_drain_deadline_waiters_get_a_503(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=60)  # no tick here
    served = asyncio.ensure_future(queue.wait(_queued("a"), FirstFree))
    stuck = asyncio.ensure_future(queue.wait(_queued("b"), FirstFree))
    await wait_until(lambda: queue.waiting == 2)
    _free(pool, worker, queue)  # "a" is served while the gateway drains ...
    assert isinstance(await served, tuple)
    worker.acquire(1, 0, 0.0)  # ... and holds the slot (the proxy's part)
    assert queue.waiting == 1  # "b" is still waiting when the deadline comes
    queue.close()
    refused = await stuck
    assert isinstance(refused, Failure) and (refused.status, refused.code) == (503, "gateway_shutting_down")
    assert queue.waiting == 0
    queue.check_invariants()
