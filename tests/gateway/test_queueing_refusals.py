"""The pool queue's refusals and exits, through the gateway: timeouts, bounds, clients that leave,
its metrics, and a pool without a queue."""

from __future__ import annotations

from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest

from tests.gateway.access_lines import capture_access
from tests.gateway.queue_rig import RigFactory, fill, queue_rigs, serve_all
from tests.support.leaving_client import leaving_chat
from tests.support.wait import wait_until


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    async with queue_rigs() as build:
        yield build


async def test_a_queue_timeout_is_a_503_with_retry_after(make_rig: RigFactory) -> None:
    rig = await make_rig(timeout_s=0.2)
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    resp = await rig.send("light", "late")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "queue_timeout"
    assert "x-should-retry" not in resp.headers  # no worker saw it: retrying sends nothing twice
    assert rig.queue.waiting == 0
    await rig.answer_one()
    assert (await hold).status_code == 200 and rig.order() == ["hold"]
    refusals = rig.state.routing.metrics.queue_refusals.children
    assert refusals[("p", "light", "timeout")].value == 1


async def test_the_bounds_refuse_at_once(make_rig: RigFactory) -> None:
    rig = await make_rig(max_per_tenant=1, max_requests=2)
    lines = capture_access(rig.state)
    tasks = await fill(rig, [("heavy", "h0", {}), ("light", "l0", {})])
    resp = await rig.send("heavy", "h1")  # heavy already has its one waiting request
    line = lines.of(resp.headers["x-request-id"])
    assert (line["status"], line["error"], line["tenant"], line["model"]) == (429, "queue_full", "heavy", "m")
    assert line["error_detail"] == "every worker is busy and 1 of your requests is already waiting"
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "queue_full"
    assert resp.json()["error"]["message"] == "every worker is busy and 1 of your requests is already waiting"
    resp = await rig.send("vip", "v0")  # the pool's queue is full
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_full"
    assert resp.json()["error"]["message"] == "every worker is busy and 2 requests are already waiting"
    await serve_all(rig, tasks)
    assert rig.order() == ["hold", "h0", "l0"]
    statuses = {key[2] for key in rig.state.routing.metrics.requests.children if key[1] in ("heavy", "vip")}
    assert statuses == {"200", "429", "503"}


async def test_a_waiter_whose_client_leaves_leaves_the_queue(make_rig: RigFactory) -> None:
    rig = await make_rig()
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    sent: list[MutableMapping[str, Any]] = []
    gone, leave = leaving_chat(rig.app, "sk-light", "gone", sent)
    await wait_until(lambda: rig.queue.waiting == 1)
    leave.set()
    await wait_until(gone.done)
    assert rig.queue.waiting == 0 and sent == []  # nobody to answer
    assert rig.state.routing.metrics.requests.children[("m", "light", "499", "chat")].value == 1
    after = rig.send("light", "after")
    await wait_until(lambda: rig.queue.waiting == 1)
    await rig.answer_one()
    await rig.answer_one()
    assert (await hold).status_code == 200 and (await after).status_code == 200
    assert rig.order() == ["hold", "after"]  # the request that left never reached the worker
    assert rig.state.gate.limiters["light"].in_flight == 0
    rig.queue.check_invariants()


async def test_queue_waits_and_depth_are_in_the_metrics(make_rig: RigFactory) -> None:
    rig = await make_rig()
    tasks = await fill(rig, [("heavy", "h0", {}), ("light", "l0", {})])
    text = rig.state.routing.metrics.render().decode()
    assert 'kvgate_queue_depth{pool="p",tenant="heavy"} 1.0' in text
    assert 'kvgate_queue_depth{pool="p",tenant="light"} 1.0' in text
    await serve_all(rig, tasks)
    text = rig.state.routing.metrics.render().decode()
    # An emptied queue reads 0 for every configured tenant: its series do not vanish.
    for tenant in ("heavy", "light", "vip"):
        assert f'kvgate_queue_depth{{pool="p",tenant="{tenant}"}} 0.0' in text
    assert 'kvgate_queue_wait_seconds_count{pool="p",tenant="light"} 1.0' in text
    assert 'kvgate_queue_wait_seconds_count{pool="p",tenant="heavy"} 1.0' in text  # "hold" never queued


async def test_without_a_queue_a_full_pool_answers_503_at_once(make_rig: RigFactory) -> None:
    rig = await make_rig(enabled=False)
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    resp = await rig.send("light", "l0")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker_available"
    assert rig.state.routing.queues == {}
    rig.gate.put_nowait(None)
    assert (await hold).status_code == 200
