"""The HTTP surface: OpenAI routes, probes and metrics, on plain Starlette (no per-request
validation layers: the hot path reads raw bytes and parses once with orjson)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway.admission import Endpoint, admit, request_id_of
from gateway.errors import ApiError
from gateway.proxy import dispatch, error_response
from gateway.state import GatewayState, make_session

log = logging.getLogger("kvgate.app")


def build_app(state: GatewayState) -> Starlette:
    """The ASGI app over a prepared state; the lifespan owns the upstream session and health loops."""

    def proxy_route(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response | ASGIApp]]:
        async def handle(request: Request) -> Response | ASGIApp:
            request_id = request_id_of(request)
            try:
                admitted = await admit(request, endpoint, state, request_id)
            except ApiError as err:
                state.metrics.requests.labels("", "", str(err.status), endpoint).inc()
                log.info("rejected", extra={"request_id": request_id, "status": err.status, "code": err.code})
                return error_response(err, request_id)
            return await dispatch(admitted, state)

        return handle

    async def models(request: Request) -> Response:
        request_id = request_id_of(request)
        if state.keyring.lookup(request.headers.get("authorization")) is None:
            err = ApiError(401, "incorrect or missing API key", "invalid_request_error", "invalid_api_key")
            return error_response(err, request_id)
        data = [
            {"id": model, "object": "model", "created": state.created_s, "owned_by": "kvgate"}
            for pool in state.registry.pools.values()
            for model in pool.config.models
        ]
        return _json({"object": "list", "data": data}, 200, request_id)

    async def healthz(request: Request) -> Response:
        return _json({"status": "ok"}, 200, request_id_of(request))

    async def readyz(request: Request) -> Response:
        if state.draining:
            return _json({"status": "draining"}, 503, request_id_of(request))
        if not state.ready:
            return _json({"status": "starting"}, 503, request_id_of(request))
        return _json({"status": "ready"}, 200, request_id_of(request))

    async def metrics(request: Request) -> Response:
        _refresh_gauges(state)
        return Response(state.metrics.render(), 200, media_type="text/plain; version=0.0.4; charset=utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        state.session = make_session(state.config)
        try:
            await state.registry.check_all(state.session)
            state.registry.start(state.session)
            state.ready = True
            yield
        finally:
            state.ready = False
            await state.registry.stop()
            await state.session.close()
            state.session = None

    routes = [
        Route("/v1/chat/completions", proxy_route("chat"), methods=["POST"]),
        Route("/v1/completions", proxy_route("completions"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed, Exception: _internal},
    )
    return app


async def drain(state: GatewayState, deadline_s: float) -> None:
    """Wait for in-flight streams to end; at the deadline, end the rest with an error event."""
    state.draining = True
    if state.active_streams:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.streams_idle.wait(), deadline_s)
    for stream in list(state.active_streams):
        stream.abort("gateway shutting down")


def _json(obj: object, status: int, request_id: str) -> Response:
    return Response(
        orjson.dumps(obj), status, headers={"x-request-id": request_id}, media_type="application/json"
    )


async def _not_found(request: Request, exc: Exception) -> Response:
    err = ApiError(
        404, f"unknown route {request.method} {request.url.path}", "invalid_request_error", "not_found"
    )
    return error_response(err, request_id_of(request))


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    err = ApiError(
        405,
        f"method {request.method} not allowed on {request.url.path}",
        "invalid_request_error",
        "method_not_allowed",
    )
    return error_response(err, request_id_of(request))


async def _internal(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc, extra={"path": request.url.path})
    err = ApiError(500, "internal gateway error", "server_error", "internal_error")
    return error_response(err, request_id_of(request))


def _refresh_gauges(state: GatewayState) -> None:
    now_s = time.monotonic()
    for pool in state.registry.pools.values():
        for worker in pool.workers.values():
            state.metrics.in_flight.labels(pool.name, worker.url).set(worker.in_flight)
            state.metrics.worker_healthy.labels(pool.name, worker.url).set(
                1 if worker.healthy and worker.breaker.allows(now_s) else 0
            )
