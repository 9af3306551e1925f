"""The pool queue's order, through the gateway: fair turns across tenants, weights, priority within
a tenant, and the queued demand the policy is shown."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.gateway.queue_rig import RigFactory, fill, queue_rigs, serve_all


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    async with queue_rigs() as build:
        yield build


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("fair", ["hold", "h0", "l0", "h1", "l1", "h2", "h3", "h4", "h5"]),
        ("fifo", ["hold", "h0", "h1", "h2", "h3", "h4", "h5", "l0", "l1"]),
    ],
)
async def test_a_flooding_tenant_does_not_make_a_light_one_wait_behind_it(
    make_rig: RigFactory, order: str, expected: list[str]
) -> None:
    rig = await make_rig(order=order)
    sends = [("heavy", f"h{i}", {}) for i in range(6)] + [("light", f"l{i}", {}) for i in range(2)]
    tasks = await fill(rig, sends)
    assert rig.queue.depths() == {"heavy": 6, "light": 2}
    await serve_all(rig, tasks)
    assert rig.order() == expected


async def test_weights_share_the_freed_slots(make_rig: RigFactory) -> None:
    rig = await make_rig()
    sends = [("heavy", f"h{i}", {}) for i in range(4)] + [("vip", f"v{i}", {}) for i in range(6)]
    tasks = await fill(rig, sends)
    await serve_all(rig, tasks)
    # vip weighs three times heavy: three turns for every one of heavy's while both wait (with
    # equal weights they would alternate, and heavy, queued first, would be served first).
    first = [tag[0] for tag in rig.order()[1:9]]
    assert first.count("v") == 6 and first.count("h") == 2


async def test_priority_orders_a_tenants_requests_in_the_gateway_alone(make_rig: RigFactory) -> None:
    rig = await make_rig()
    sends = [("light", f"p{p}", {"priority": p}) for p in (5, 0, -1)]
    tasks = await fill(rig, sends)
    await serve_all(rig, tasks)
    assert rig.order() == ["hold", "p-1", "p0", "p5"]
    # The pool's engines do not schedule by priority (`priority_scheduling` "off"): the client's
    # value never reaches them (tests/gateway/test_engine_priority.py).
    assert [body.get("priority") for body in rig.arrivals[1:]] == [None, None, None]


async def test_priority_must_be_an_integer(make_rig: RigFactory) -> None:
    rig = await make_rig()
    for bad in ("high", 1.5, [1], None):  # lax mode reads true and "2" as integers
        resp = await rig.send("light", "bad", priority=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
    assert rig.arrivals == []


async def test_the_policy_sees_the_queued_demand(make_rig: RigFactory) -> None:
    rig = await make_rig()
    tasks = await fill(rig, [("heavy", f"h{i}", {}) for i in range(3)])
    await serve_all(rig, tasks)
    seen = {req.request_id: req.queued_requests for req in rig.policy.requests}
    # Routed from the queue with 2, 1, then 0 others still waiting; the first found the slot free.
    assert sorted(seen.values(), reverse=True)[:3] == [2, 1, 0]
    assert rig.policy.requests[0].queued_requests == 0
