"""A Responses follow-up whose holder this gateway process does not know: found before routing.

The tenant's own `previous_response_id` (its tag checked at admission, `responses_ids`) that this
process never routed or has forgotten (another process or replica routed it, or this one
restarted) is looked for on the workers of the request's pool (`responses_affinity.find_holder`:
the first to answer 200 to `GET /v1/responses/{id}` holds it), and the request is pinned there
as a known follow-up would be.
"""

from __future__ import annotations

import time
from typing import Literal

from gateway.admission import Admitted
from gateway.errors import ApiError
from gateway.registry import Pool, Worker
from gateway.responses_affinity import find_holder, holds, not_found
from gateway.transport import Transport


async def locate_previous(a: Admitted, transport: Transport) -> ApiError | None:
    """A Responses follow-up whose holder this process does not know (`Admitted.find_previous`):
    pin it to the worker of its pool that holds it, and remember that worker; vLLM's 404 when
    none does (a follow-up sent anywhere else would get it from the worker)."""
    previous, a.find_previous = a.find_previous, None
    if previous is None:
        return None
    headers = {"x-request-id": a.request_id, **a.pool.auth.headers}

    async def holding(pool: Pool, worker: Worker) -> Literal[True] | None:
        return await holds(transport.upstream(), pool, worker, previous, headers)

    found = await find_holder((a.pool,), holding)
    if found is None:
        return not_found(previous)
    holder = found.worker.worker_id
    a.pinned = holder
    if a.responses is not None:
        a.responses.learn(previous, a.tenant.name, a.pool.name, holder, time.monotonic())
    return None
