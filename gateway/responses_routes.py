"""`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: to the worker holding the response.

Only the tenant that created a response reaches it (`responses_affinity`); anything else, and an id
the gateway does not know, is vLLM's 404. The request counts against the tenant's concurrency and
rpm like any other; the worker's answer is passed through (its errors in the gateway's shape).
"""

from __future__ import annotations

import time
from urllib.parse import quote

import aiohttp
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission import new_request_id, request_id_of
from gateway.errors import ApiError, normalize_worker_error, upstream_error
from gateway.gate import Gate
from gateway.metrics import GatewayMetrics
from gateway.quotas import Rejection
from gateway.registry import Registry
from gateway.responses_affinity import ResponseAffinity, not_found
from gateway.surface import error
from gateway.transport import Transport

_NO_KEY = ApiError(401, "incorrect or missing API key", "invalid_request_error", "invalid_api_key")


def _rejected(rejection: Rejection) -> ApiError:
    retry_after = str(max(1, int(rejection.retry_after_s + 0.999)))
    return ApiError(
        429, rejection.message, "rate_limit_error", rejection.code, None, {"retry-after": retry_after}
    )


def responses_routes(
    gate: Gate, registry: Registry, metrics: GatewayMetrics, transport: Transport
) -> list[Route]:
    """The stored-response routes: a tenant's key and a slot of its limiter (`gate`), the worker
    that holds the response (`gate.responses`, `registry`), reached with the process's session."""

    async def forward(request: Request, suffix: str, endpoint: str) -> Response:
        reply_id = request_id_of(request)
        tenant = gate.keyring.lookup(request.headers.get("authorization"))
        if tenant is None:
            return error(_NO_KEY, reply_id)
        now_s = time.monotonic()
        limiter = gate.limiter(tenant)
        rejection = limiter.enter(now_s)
        if rejection is not None:
            metrics.requests.labels("", tenant.name, "429", endpoint).inc()
            return error(_rejected(rejection), reply_id)
        try:
            status, body = await _to_holder(
                gate.responses,
                registry,
                transport,
                request.path_params["response_id"],
                tenant.name,
                suffix,
                request,
            )
        except ApiError as err:
            status, body = err.status, err.body()
        finally:
            limiter.leave()
        metrics.requests.labels("", tenant.name, str(status), endpoint).inc()
        if status >= 400:
            body = normalize_worker_error(status, body)
        return Response(body, status, headers={"x-request-id": reply_id}, media_type="application/json")

    async def retrieve(request: Request) -> Response:
        return await forward(request, "", "responses.retrieve")

    async def cancel(request: Request) -> Response:
        return await forward(request, "/cancel", "responses.cancel")

    return [
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    ]


async def _to_holder(
    responses: ResponseAffinity,
    registry: Registry,
    transport: Transport,
    response_id: str,
    tenant: str,
    suffix: str,
    request: Request,
) -> tuple[int, bytes]:
    held = responses.holder(response_id, tenant, time.monotonic())
    pool = registry.pools.get(held.pool) if held is not None else None
    if held is None or pool is None or held.worker not in pool.workers:
        raise not_found(response_id)
    worker = pool.workers[held.worker]
    url = f"{worker.url}/v1/responses/{quote(response_id, safe='')}{suffix}"
    headers = {"x-request-id": new_request_id()}
    try:
        async with transport.upstream().request(
            request.method, url, headers=headers, params=request.query_params, timeout=pool.client_timeout
        ) as resp:
            return resp.status, await resp.read()
    except TimeoutError:
        raise upstream_error(504, "the worker holding the response did not answer in time") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise upstream_error(
            502, f"could not reach the worker holding the response ({type(exc).__name__})"
        ) from None
