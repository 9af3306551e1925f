"""The HTTP surface.

Every proxied POST route (`gateway.routes.ROUTES`: chat, completions, Responses, Anthropic
Messages, embeddings, pooling, score, rerank, tokenizer and audio routes) is dispatched straight
from the ASGI entry point with one dict lookup (no routing or middleware layers on the hot path:
raw bytes in, one parse, raw bytes out); probes, /v1/models, /health, /version, the lifespan and
404/405 go through a small Starlette app. With `cors` on, both run inside the CORS layer
(`gateway/cors.py`, `CorsGatewayApp`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import anthropic
from gateway.admin import admin_routes
from gateway.admission import Refused, admit, authenticate, enter, read_body
from gateway.admitted import Admitted
from gateway.auth import Tenant
from gateway.canary import Canaries
from gateway.cors import Cors, serves
from gateway.errors import ApiError, echoed
from gateway.fleet import Fleet
from gateway.gauges import refresh_gauges
from gateway.heartbeat import start_beating
from gateway.lifecycle import SHUTTING_DOWN, ProcessGroup, RequestCap
from gateway.outcome import CLIENT_DISCONNECTED, record_refusal
from gateway.policy_watch import PolicyWatcher
from gateway.proxy import dispatch
from gateway.request_head import RequestHead, RequestIds, request_id_of, request_ids
from gateway.responses_routes import responses_routes
from gateway.routes import ROUTES, ApiRoute
from gateway.routing import Routing
from gateway.state import GatewayState
from gateway.surface import allow_header, error, json_response, surface_routes

log = logging.getLogger("kvgate.app")


def _overloaded() -> ApiError:
    # The same words whether the process is full or the tenant holds its share of it at the cap:
    # the share would tell a tenant how many others are sending (docs/gateway.md, "Errors").
    return ApiError(
        503,
        "the gateway is at its limit of requests in flight; retry shortly",
        "server_error",
        "gateway_overloaded",
        None,
        {"retry-after": "1"},
    )


class GatewayApp:
    """ASGI entry point: POSTs to a proxied route go to the proxy, everything else to the
    Starlette fallback."""

    def __init__(self, state: GatewayState, fallback: Starlette) -> None:
        self.gate = state.gate
        self.routing = state.routing
        self.transport = state.transport
        self.lifecycle = state.lifecycle
        weights = {t.name: t.weight for t in state.config.tenants}
        self.requests = RequestCap(state.config.limits.max_in_flight_requests, weights)
        state.lifecycle.requests = self.requests
        self.fallback = fallback
        # With tracing on, each completion runs inside its SERVER span (gateway/tracing.py).
        tracer = state.routing.tracer
        self._completion = self._proxy if tracer is None else tracer.wrap(self._proxy)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            api = ROUTES.get(scope["path"])
            if api is not None:
                await self._completion(scope, receive, send, api)
                return
        await self.fallback(scope, receive, send)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, api: ApiRoute) -> None:
        gate = self.gate
        started_s = time.monotonic()
        head = RequestHead.of(scope) if api.plain_head else RequestHead.of_route(scope, api)
        ids = request_ids(head)
        try:
            tenant = authenticate(head, gate)
        except ApiError as err:
            await self._rejected(err, api, ids, started_s)(scope, receive, send)
            return
        try:
            # The tenant's own slot first, from the headers alone; the body is read under the
            # connection's deadline (gateway/http_limits.py) and only then is gateway-wide capacity
            # taken: a tenant's slow or partial bodies hold its own slots, never everyone's.
            enter(head, gate, tenant, started_s)
        except ApiError as err:
            await self._rejected(err, api, ids, started_s, tenant)(scope, receive, send)
            return
        limiter = gate.limiters[tenant.name]
        places = self.requests.tenant(tenant.name)
        try:
            raw = await read_body(receive, head, gate.limits.max_body_bytes)
            if not places.take():  # the gateway-wide cap, and the tenant's share of it
                raise _overloaded()
        except ApiError as err:
            limiter.leave()
            await self._rejected(err, api, ids, started_s, tenant)(scope, receive, send)
            return
        except ClientDisconnect:
            limiter.leave()  # the client left while sending its body: nobody to answer
            self._refused(499, CLIENT_DISCONNECTED, api.endpoint, ids, started_s, tenant)
            return
        except BaseException:
            limiter.leave()
            raise
        try:
            await self._handle(scope, receive, send, api, raw, ids, tenant, started_s, head)
        finally:
            places.give_back()

    def _rejected(
        self,
        err: ApiError,
        api: ApiRoute,
        ids: RequestIds,
        started_s: float,
        tenant: Tenant | None = None,
        refused: Refused | None = None,
    ) -> ASGIApp:
        """The error response to a request refused before admission, its metric and its access
        line (the error's code; its `type` when it has none). `refused` says what `admit` knew."""
        error = err.code or err.type
        if refused is None:
            self._refused(err.status, error, api.endpoint, ids, started_s, tenant)
        else:
            self._refused(
                err.status, error, refused.endpoint, ids, started_s, tenant, refused.model, refused.stream
            )
        return api.dialect.error_response(err, ids.reply)

    def _refused(
        self,
        status: int,
        error: str,
        endpoint: str,
        ids: RequestIds,
        started_s: float,
        tenant: Tenant | None,
        model: str | None = None,
        stream: bool | None = None,
    ) -> None:
        """Count and log a request that ends before admission. Its metric's model is the served
        model once `admit` resolved it (a refusal after that: the tpm quota, a prompt too long);
        else empty: only a configured model may become a label value, never the client's string."""
        name = tenant.name if tenant is not None else None
        served = model if model is not None and model in self.gate.models else ""
        self.routing.metrics.rejected(endpoint, status, name or "", served)
        record_refusal(
            self.routing,
            ids,
            endpoint,
            started_s,
            status=status,
            error=error,
            tenant=name,
            model=model,
            stream=stream,
        )

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        api: ApiRoute,
        raw: bytes,
        ids: RequestIds,
        tenant: Tenant,
        started_s: float,
        head: RequestHead,
    ) -> None:
        response: ASGIApp
        admitted: Admitted | None = None
        try:
            try:
                admitted = await admit(raw, api, self.gate, ids, tenant, started_s, head)
            except Refused as refused:
                response = self._rejected(refused.error, api, ids, started_s, tenant, refused)
            except ApiError as err:
                response = self._rejected(err, api, ids, started_s, tenant)
            else:
                lifecycle = self.lifecycle
                with lifecycle.waiting_on_worker(receive) as guard:  # the drain deadline may end it
                    try:
                        response = await dispatch(admitted, self.routing, self.transport, lifecycle)
                    except asyncio.CancelledError:
                        if guard.fired:
                            return  # dispatch recorded the 499 and closed the upstream request
                        raise
        except Exception as exc:
            log.error("unhandled error", exc_info=exc, extra={"request_id": ids.internal})
            if admitted is None:
                self._refused(500, "internal_error", api.endpoint, ids, started_s, tenant)
            response = api.dialect.error_response(
                ApiError(500, "internal gateway error", "server_error", "internal_error"), ids.reply
            )
        finally:
            if admitted is None:
                self.gate.limiters[tenant.name].leave()  # else the request's record gives the slot back
        await response(scope, receive, send)


class CorsGatewayApp(GatewayApp):
    """The entry point inside the CORS layer (`gateway/cors.py`): its own class, so that with
    CORS off the entry point is exactly `GatewayApp`'s and pays nothing for it."""

    def __init__(self, state: GatewayState, fallback: Starlette) -> None:
        super().__init__(state, fallback)
        self._cors = Cors(state.config.cors, serves(fallback.routes, ROUTES.__contains__))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._cors(scope, receive, send, super().__call__)


def build_app(state: GatewayState, watcher: PolicyWatcher | None = None) -> GatewayApp:
    """The ASGI app over a prepared state; the lifespan owns the upstream sessions and health loops."""

    lifecycle, transport = state.lifecycle, state.transport

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        transport.open(state.config.upstream)
        # The gateway's own checks of its workers go on a session of their own: client traffic
        # filling the shared pool cannot make a healthy worker's checks time out.
        probes = transport.prober()
        flusher: asyncio.Task[None] | None = None
        announcer: asyncio.Task[None] | None = None
        fleet = Fleet(state.config, state.registry, state.routing, state.gate.keyring.salt_namespaces, probes)
        state.fleet = fleet
        # Before the rest starts: the supervisor of `--processes` hears from this loop meanwhile.
        heartbeat = start_beating(os.environ)
        try:
            await fleet.start()
            if state.config.sync.url is not None:
                from gateway.sync.service import SyncService  # nats-py only when sync is on

                state.sync = SyncService(
                    state.registry,
                    state.routing,
                    state.config.sync,
                    secret=state.secret,
                    limiters=state.gate.limiters,
                )
                await state.sync.start()  # connects in the background: never waits on the broker
            await state.registry.check_all(probes)
            state.registry.start(probes)
            state.canaries = Canaries(state.registry, probes)
            state.canaries.start()
            flusher = asyncio.create_task(_flush_logs(state.routing), name="access-log")
            if watcher is not None:
                await watcher.start()
            lifecycle.discovering = fleet.discovering
            if pools := fleet.discovering():
                log.info("ready once the first workers of these pools are known: %s", ", ".join(pools))
            lifecycle.group = ProcessGroup.from_env(os.environ)
            lifecycle.started = True
            announcer = asyncio.create_task(
                lifecycle.group.announce(lambda: lifecycle.ready), name="announce-ready"
            )
            yield
        finally:
            lifecycle.started = False
            if announcer is not None:
                announcer.cancel()
            if flusher is not None:
                flusher.cancel()
            await state.routing.stop_background()  # before the books, logs and transport close
            if state.canaries is not None:
                await state.canaries.stop()
                state.canaries = None
            if watcher is not None:
                await watcher.stop()
            if state.sync is not None:
                await state.sync.stop()
                state.sync = None
            await fleet.stop()
            state.fleet = None
            state.routing.access_log.flush()
            if state.routing.decision_log is not None:
                state.routing.decision_log.close()
            await state.registry.stop()
            await transport.close()
            state.gate.keying.close_executor()
            if state.routing.tracer is not None:
                await asyncio.to_thread(state.routing.tracer.shutdown)  # export the last spans
            if heartbeat is not None:
                heartbeat.cancel()  # last: it beats for as long as this loop runs the app

    routes = [
        *surface_routes(state.gate, state.registry, state.created_s),
        *responses_routes(
            state.gate,
            state.registry,
            state.routing,
            transport,
            state.lifecycle,
            tracing=state.routing.tracer is not None,
        ),
        *probe_routes(state),
        *admin_routes(state, watcher),
    ]
    fallback = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed, Exception: _internal},
    )
    # Starlette would answer a trailing-slash path with a 307 whose Location is built from the
    # client's Host header; an unknown route is a 404 like any other.
    fallback.router.redirect_slashes = False
    if state.config.cors.enabled:
        return CorsGatewayApp(state, fallback)
    return GatewayApp(state, fallback)


def probe_routes(state: GatewayState) -> list[Route]:
    """`/healthz` (the process answers) and `/readyz` (503 while starting, while a pool's first
    workers are not yet known, while another process of a `--processes` group is not ready, or
    while draining; a process held down is not waited for, and is counted in the body and in
    `kvgate_processes_held`)."""
    lifecycle = state.lifecycle
    # Read from the same files as `/readyz`, at scrape time (`lifecycle.group` is set at startup).
    state.routing.metrics.processes_held.set_function(lambda: lifecycle.group.peers_held())

    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok"}, 200, request_id_of(request))

    async def readyz(request: Request) -> Response:
        if lifecycle.draining:
            return json_response({"status": "draining"}, 503, request_id_of(request))
        if not lifecycle.started:
            return json_response({"status": "starting"}, 503, request_id_of(request))
        if pools := lifecycle.discovering():
            # A count, not the names: the client port answers this without a key (the start logs them).
            reason = f"waiting for the first workers of {len(pools)} pool(s) (discovery)"
            return json_response({"status": "starting", "reason": reason}, 503, request_id_of(request))
        group = lifecycle.group
        held = {"held": k} if (k := group.peers_held()) else {}  # a count: the fault stays visible
        if waiting := group.peers_waiting():
            # `--processes N`: the probes ask process 0 for the pod, and another process is not
            # ready yet (still waiting for its first workers, or restarted).
            reason = f"waiting for {waiting} of {len(group.peer_files)} other gateway process(es)"
            body = {"status": "starting", "reason": reason, **held}
            return json_response(body, 503, request_id_of(request))
        return json_response({"status": "ready", **held}, 200, request_id_of(request))

    return [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"])]


def build_metrics_app(state: GatewayState) -> Starlette:
    """`GET /metrics` for the metrics listener (`metrics.listen`): the client port has no metrics
    route, as the metrics name tenants and workers. The probes are served here too: this listener
    has no connection cap, so a client port full of connections (`max_client_connections`) does not
    fail the kubelet's probes and restart the busiest pods."""

    async def metrics(request: Request) -> Response:
        refresh_gauges(state)
        return Response(
            state.routing.metrics.render(), 200, media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    app = Starlette(
        routes=[Route("/metrics", metrics, methods=["GET"]), *probe_routes(state)],
        exception_handlers={404: _not_found, 405: _method_not_allowed, Exception: _internal},
    )
    app.router.redirect_slashes = False
    return app


async def drain(state: GatewayState, deadline_s: float) -> None:
    """Let what is in flight finish until the deadline, then end what is left, each with
    `gateway_shutting_down`: open streams with a terminal error event, requests queued for a worker
    or still waiting on one with a 503 (`Lifecycle.end_dispatching`). Returns at the deadline; the
    server stops before it once nothing is in flight, and cancels this task then."""
    lifecycle = state.lifecycle
    lifecycle.draining = True
    # Queued requests keep their place until the deadline (workers still free slots meanwhile),
    # and a request that arrived just before the listener closed gets the full deadline too.
    await asyncio.sleep(deadline_s)
    for stream in list(lifecycle.active_streams):
        stream.abort(SHUTTING_DOWN)
    for queue in state.routing.queues.values():
        queue.close()
    lifecycle.end_dispatching()


async def _flush_logs(routing: Routing) -> None:
    """The access log and the decision log reach their files on the access log's cadence."""
    while True:
        await asyncio.sleep(routing.access_log.flush_interval_s)
        routing.access_log.flush()
        if routing.decision_log is not None:
            routing.decision_log.flush()


def _route_error(request: Request, err: ApiError) -> Response:
    """`err` in the shape of the API the path belongs to: Anthropic's under `/v1/messages`
    (its clients read no other), the OpenAI shape elsewhere."""
    if anthropic.owns_path(request.url.path):
        headers = {"x-request-id": request_id_of(request), **err.headers}
        return Response(
            anthropic.error_body(err.status, err.message), err.status, headers, "application/json"
        )
    return error(err, request_id_of(request))


async def _not_found(request: Request, exc: Exception) -> Response:
    err = ApiError(
        404,
        f"unknown route {request.method} {echoed(request.url.path)}",
        "invalid_request_error",
        "not_found",
    )
    return _route_error(request, err)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    err = ApiError(
        405,
        f"method {echoed(request.method)} not allowed on {echoed(request.url.path)}",
        "invalid_request_error",
        "method_not_allowed",
        headers=allow_header(exc),
    )
    return _route_error(request, err)


async def _internal(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc, extra={"path": request.url.path})
    err = ApiError(500, "internal gateway error", "server_error", "internal_error")
    return _route_error(request, err)
