"""The queue's refusals carry the error `type` of their status: a tenant's 429 `queue_full` a
`rate_limit_error`, as every other 429 of the gateway; the pool's 503 a `server_error`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.errors import error_type
from tests.gateway.queue_rig import RigFactory, fill, queue_rigs, serve_all


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    async with queue_rigs() as build:
        yield build


async def test_a_tenants_full_queue_is_a_rate_limit_error(make_rig: RigFactory) -> None:
    rig = await make_rig(max_per_tenant=1, max_requests=2)
    tasks = await fill(rig, [("heavy", "h0", {}), ("light", "l0", {})])
    tenant_full = await rig.send("heavy", "h1")
    assert tenant_full.status_code == 429
    assert tenant_full.json()["error"]["type"] == "rate_limit_error"
    assert tenant_full.json()["error"]["code"] == "queue_full"
    pool_full = await rig.send("vip", "v0")
    assert pool_full.status_code == 503
    assert pool_full.json()["error"]["type"] == "server_error"
    await serve_all(rig, tasks)


@pytest.mark.parametrize(
    ("status", "type_"),
    [(429, "rate_limit_error"), (502, "server_error"), (503, "server_error"), (504, "server_error")],
)
def test_the_type_of_each_failure_status(status: int, type_: str) -> None:
    assert error_type(status) == type_
