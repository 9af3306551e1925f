"""A Responses follow-up whose holder this gateway process does not know: found before routing.

The tenant's own `previous_response_id` (its tag checked at admission, `responses_ids`) that this
process never routed or has forgotten (another process or replica routed it, or this one
restarted) is looked for on the workers of the request's pool (`responses_search.find_holder`:
the first to answer 200 to `GET /v1/responses/{id}` holds it), and the request is pinned there
as a known follow-up would be.

Each worker is asked with the headers the follow-up itself will carry to it
(`upstream_headers.worker_headers`): the gateway's request id, the pool's key for its workers and
the client headers the pool forwards, so a worker behind its own auth answers the search as it
will answer the follow-up. While the gateway traces, the search carries the request's SERVER span
as its trace context (the follow-up's attempt carries its own CLIENT span): the worker's spans,
if it traces the lookup, join the client's trace.
"""

from __future__ import annotations

import time
from typing import Literal

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.admitted import Admitted
from gateway.errors import ApiError
from gateway.registry import Pool
from gateway.responses_affinity import check_continuable, not_found
from gateway.responses_search import find_holder, holds
from gateway.transport import Transport
from gateway.upstream_headers import worker_headers
from gateway.worker import Worker

_W3C = TraceContextTextMapPropagator()


async def locate_previous(a: Admitted, transport: Transport) -> ApiError | None:
    """A Responses follow-up whose holder this process does not know (`Admitted.find_previous`):
    pin it to the worker of its pool that holds it, and remember that worker; vLLM's 404 when
    every worker says it does not (a follow-up sent anywhere else would get it from the worker);
    503 with `Retry-After` when none holds it and one could not tell (busy, unreachable, unhealthy:
    `find_holder`); 502 `worker_auth_failed` when a worker refuses the gateway's credentials;
    400 when the holder cannot continue it (`check_continuable`: an SGLang decode server)."""
    previous, a.find_previous = a.find_previous, None
    if previous is None:
        return None
    headers = worker_headers(a.request_id, a.pool.auth, a.client_headers, _trace_context())

    async def holding(pool: Pool, worker: Worker) -> Literal[True] | None:
        return await holds(transport.upstream(), pool, worker, previous, headers)

    try:
        found = await find_holder((a.pool,), holding, "previous_response_id")
    except ApiError as undecided:  # one could not tell, or refused the gateway's credentials
        return undecided
    if found is None:
        return not_found(previous)
    holder = found.worker.worker_id
    if a.responses is not None:
        a.responses.learn(previous, a.tenant.name, a.pool.name, holder, time.monotonic())
    try:
        check_continuable(a.pool, found.worker)  # as `pin` refuses a known holder
    except ApiError as refused:
        return refused
    a.pinned = holder
    return None


def _trace_context() -> list[tuple[str, str]]:
    """`traceparent` (and `tracestate`) of the current span: the request's SERVER span while the
    gateway traces (`tracing.RequestTracer.wrap`); none otherwise (then a pool that forwards the
    client's own `traceparent` has it among the forwarded headers)."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return list(carrier.items())
