"""`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: to the worker holding the response.

Only the tenant that created a response reaches it: an id that is not the asking tenant's
(`responses_ids`, told from the id alone) is vLLM's 404, answered without asking a worker. One of
its own goes to the worker this process saw create it (`responses_affinity`), or, when this
process does not know it, to the first healthy worker of the pool its id names (every pool's, for
an id naming none: `responses_search.pools_to_search`) that answers a `GET` of it 200 (each asked
in turn: `responses_search.find_holder`; the gateway's 404 when every worker says it does not,
a 503 with `Retry-After` when one could not tell). The request counts
against the tenant's concurrency and rpm like any other; the worker's answer is passed through
(its errors in the gateway's shape), and a retrieve the worker answers with an event stream
(`stream=true`) is relayed as one (`responses_stream.py`). As on the proxied routes, a client
that leaves while the request waits on a worker closes the worker's request (counted 499), and
the drain deadline answers one still waiting with 503 `gateway_shutting_down`. The worker gets
what a proxied request would send it: the pool's API key for its workers, the client headers the
pool forwards, and the query string (`stream`, `starting_after`).

These requests are outside `limits.max_in_flight_requests`; each one a worker is asked (the
holder's, and each `GET` of the search) takes a place of `transport.StoredPlaces`, the bound per
worker and per process, with each tenant's share, until its answer ends: one refused is a 503
`gateway_overloaded` with `Retry-After: 1` (in the search, a worker that could not tell). A `HEAD`
is answered as a `GET`'s head: the worker is sent a `GET`, the body is not sent (nor a stream
relayed: its head alone, and the worker's stream closed).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.config.pool import TimeoutsConfig
from gateway.errors import ApiError, normalize_worker_error, upstream_error, withhold_salts
from gateway.failure import (
    BUSY_STATUSES,
    REFUSED_CREDENTIALS,
    TRANSPORT_ERRORS,
    Failure,
    Stage,
    failure_of,
    worker_status,
)
from gateway.gate import Gate
from gateway.lifecycle import Lifecycle, shutting_down
from gateway.outcome import CLIENT_DISCONNECTED, record_refusal
from gateway.quotas import Rejection
from gateway.registry import Pool, Registry
from gateway.request_head import RequestIds, client_request_id, new_request_id
from gateway.responses_affinity import ResponseAffinity, not_found
from gateway.responses_search import Undecided, find_holder, holds, pools_to_search, stored_url
from gateway.responses_stream import StoredResponseStream, stream_head
from gateway.routes import CANCEL_RESPONSE_PATH, STORED_RESPONSE_PATH
from gateway.routing import Routing
from gateway.streaming import AiohttpSource
from gateway.surface import error, tenant_of
from gateway.tracing import TRACE_CONTEXT_HEADERS
from gateway.transport import StoredPlace, Transport
from gateway.upstream import UpstreamError
from gateway.upstream_headers import aiohttp_pairs, pick, worker_headers
from gateway.worker import Worker
from policies.base import Outcome

# The `endpoint` labels of the stored-response routes (the proxied routes' are in `routes.ROUTES`).
RETRIEVE_ENDPOINT = "responses.retrieve"
CANCEL_ENDPOINT = "responses.cancel"
STORED_RESPONSE_ENDPOINTS = (RETRIEVE_ENDPOINT, CANCEL_ENDPOINT)

_TRACE_CONTEXT = frozenset(name.encode() for name in TRACE_CONTEXT_HEADERS)


def _overloaded() -> ApiError:
    """The answer to a request refused a place of `transport.StoredPlaces` (the same whichever
    cap refused it: a tenant is not told its share, which would tell it how many others ask)."""
    return ApiError(
        503,
        "too many stored-response requests in flight to the worker holding the response; retry shortly",
        "server_error",
        "gateway_overloaded",
        None,
        {"retry-after": "1"},
    )


def _rejected(rejection: Rejection, rate_headers: list[tuple[bytes, bytes]]) -> ApiError:
    headers = {"retry-after": str(max(1, int(rejection.retry_after_s + 0.999)))}
    headers |= {name.decode(): value.decode() for name, value in rate_headers}
    return ApiError(429, rejection.message, "rate_limit_error", rejection.code, None, headers)


def responses_routes(
    gate: Gate,
    registry: Registry,
    routing: Routing,
    transport: Transport,
    lifecycle: Lifecycle,
    tracing: bool = False,
) -> list[Route]:
    """The stored-response routes: a tenant's key and a slot of its limiter (`gate`), the worker
    that holds the response (`gate.responses`, `registry`), reached with the process's session;
    each request counted (`routing.metrics`) and logged (one access line) when it ends.
    With `tracing` the client's own trace context goes to the worker (these routes open no span
    of their own), so the worker's spans join the client's trace."""
    metrics = routing.metrics

    async def forward(request: Request, suffix: str, endpoint: str) -> Response:
        started_s = time.monotonic()
        ids = RequestIds(new_request_id(), client_request_id(request))
        reply_id = ids.reply
        try:
            tenant = tenant_of(request, gate)
        except ApiError as err:
            metrics.rejected(endpoint, err.status)
            record_refusal(routing, ids, endpoint, started_s, status=err.status, error=err.code)
            return error(err, reply_id)
        limiter = gate.limiter(tenant)
        rejection = limiter.enter(started_s)
        if rejection is not None:
            refused = _rejected(rejection, limiter.rate_headers(started_s))
            metrics.requests.labels("", tenant.name, "429", endpoint).inc()
            record_refusal(
                routing, ids, endpoint, started_s, status=429, error=refused.code, tenant=tenant.name
            )
            return error(refused, reply_id)
        worker: str | None = None
        salts = (tenant.cache_salt, gate.keyring.public_salt)
        call = _Retrieval(
            transport,
            request.path_params["response_id"],
            tenant.name,
            suffix,
            request,
            tracing,
            ids.internal,
        )

        def withhold(text: bytes) -> bytes:
            """A worker's error without the salts this tenant's requests carry: the response was
            made from one of them, and an error about it may quote it."""
            return withhold_salts(text, salts)

        def done(status: int, code: str | None = None) -> None:
            """`code`: the error the gateway answered (None for a worker's answer, passed on)."""
            limiter.leave()
            call.release()
            metrics.requests.labels("", tenant.name, str(status), endpoint).inc()
            record_refusal(
                routing,
                ids,
                endpoint,
                started_s,
                status=status,
                error=code,
                tenant=tenant.name,
                worker=worker,
            )

        if lifecycle.past_deadline:  # arrived just before the listener closed
            ended = shutting_down()
            done(ended.status, ended.code)
            return error(ended, reply_id)
        # Until the worker's answer is whole (or its stream is handed on), the client leaving
        # cancels the request, and so closes the worker's, as the drain deadline does.
        with lifecycle.waiting_on_worker(request.receive) as guard:
            try:
                try:
                    pool, worker, source = await _to_holder(gate.responses, registry, call)
                except ApiError as err:
                    done(err.status, err.code or err.type)
                    return error(err, reply_id)
                if source.status == 200 and _is_event_stream(source.content_type):
                    if request.method == "HEAD":  # a stream's head alone: nothing to relay
                        source.close()
                        done(200)
                        head = stream_head(reply_id, limiter.rate_headers(time.monotonic()))
                        # As the stream's head: no Content-Length (a `Response` would say 0).
                        headers = {name.decode(): value.decode() for name, value in head}
                        return StreamingResponse(iter(()), status_code=200, headers=headers, media_type=None)
                    # The stream gives the limiter's slot back, and counts the request, when it ends.
                    return StoredResponseStream(
                        source,
                        reply_id,
                        lifecycle,
                        pool.config.timeouts,
                        done,
                        withhold,
                        limiter.rate_headers(time.monotonic()),
                    )
                try:
                    status, body = await _whole(source, pool.config.timeouts)
                except ApiError as err:
                    done(err.status, err.code or err.type)
                    return error(err, reply_id)
            except asyncio.CancelledError:
                if lifecycle.ended_by_drain():
                    ended = shutting_down()
                    done(ended.status, ended.code)
                    return error(ended, reply_id)
                done(499, CLIENT_DISCONNECTED)
                if guard.fired:
                    return Response(status_code=499)  # to no one: the client has gone
                raise
            except BaseException:
                done(500, "internal_error")  # a bug
                raise
        done(status)
        if status >= 400:
            body = normalize_worker_error(status, body)
        if status != 200:
            body = withhold(body)
        headers = {"x-request-id": reply_id}
        headers |= {name.decode(): value.decode() for name, value in limiter.rate_headers(time.monotonic())}
        return Response(body, status, headers=headers, media_type="application/json")

    async def retrieve(request: Request) -> Response:
        return await forward(request, "", RETRIEVE_ENDPOINT)

    async def cancel(request: Request) -> Response:
        return await forward(request, "/cancel", CANCEL_ENDPOINT)

    return [
        Route(STORED_RESPONSE_PATH, retrieve, methods=["GET"]),
        Route(CANCEL_RESPONSE_PATH, cancel, methods=["POST"]),
    ]


@dataclass(slots=True)
class _Retrieval:
    """One client request for a stored response (`suffix`: "" or "/cancel"), as a worker is
    asked it; `request_id` names it to the worker. `place`: its place at the holder
    (`transport.StoredPlaces`), from the moment the holder is asked until `release`."""

    transport: Transport
    response_id: str
    tenant: str
    suffix: str
    request: Request
    tracing: bool
    request_id: str
    place: StoredPlace | None = None

    def take_place(self, worker_url: str) -> StoredPlace:
        """A place at the worker for this request, or the client's 503 (`_overloaded`)."""
        place = self.transport.stored.take(worker_url, self.tenant)
        if place is None:
            raise _overloaded()
        return place

    def release(self) -> None:
        """Give back the place at the holder, once the request has ended (more calls: nothing)."""
        if self.place is not None:
            self.place.give_back()
            self.place = None

    def headers(self, pool: Pool) -> list[tuple[str, str]]:
        """The headers a proxied request carries to a worker of `pool`: the pool's worker key,
        the headers it forwards, the client's trace context while tracing."""
        raw = self.request.scope["headers"]
        trace = aiohttp_pairs(pick(raw, _TRACE_CONTEXT)) if self.tracing else ()
        return worker_headers(self.request_id, pool.auth, pick(raw, pool.forward), trace)

    async def ask(self, pool: Pool, worker_url: str) -> AiohttpSource:
        """The worker's answer head to the client's request (its method, a `HEAD` as a `GET`, and
        its query string)."""
        method = "GET" if self.request.method == "HEAD" else self.request.method
        resp = await self.transport.upstream().request(
            method,
            stored_url(worker_url, self.response_id, self.suffix),
            headers=self.headers(pool),
            params=list(self.request.query_params.multi_items()),
            timeout=pool.client_timeout,
        )
        return AiohttpSource(resp, self.transport.answers.share(self.tenant))

    async def holds(self, pool: Pool, worker: Worker) -> Literal[True] | None:
        """Whether `worker` holds the response (`responses_search.holds`), asked under a place
        at it: without one, it could not tell (`Undecided`, a 503 if no other worker holds it)."""
        place = self.transport.stored.take(worker.url, self.tenant)
        if place is None:
            raise Undecided(_NO_PLACE)
        try:
            return await holds(self.transport.upstream(), pool, worker, self.response_id, self.headers(pool))
        finally:
            place.give_back()


_NO_PLACE = Failure(
    503,
    "too many stored-response requests in flight to it",
    "gateway_overloaded",
    Outcome.ABORTED,
)


async def _to_holder(
    responses: ResponseAffinity, registry: Registry, call: _Retrieval
) -> tuple[Pool, str, AiohttpSource]:
    """The answer head of the worker holding the response (its body still to be read), the pool
    the worker is in and its URL. An id that is not the tenant's is a 404 that reaches no worker;
    one of its own that this process does not know is looked for (`_find_holder`)."""
    if not responses.ids.owned_by(call.response_id, call.tenant):
        raise not_found(call.response_id)
    held = responses.holder(call.response_id, call.tenant, time.monotonic())
    if held is None:
        return await _find_holder(responses, registry, call)
    pool = registry.pools.get(held.pool)
    if pool is None or held.worker not in pool.workers:
        raise not_found(call.response_id)
    worker = pool.workers[held.worker]
    if not (worker.healthy and worker.breaker.allows(time.monotonic())):
        # As a follow-up naming it gets (`holder_unavailable`): the one worker that has it is down
        # for now, and the client may try again later.
        raise upstream_error(
            503, "the worker holding the response is unavailable (unhealthy); no other worker has it"
        )
    return pool, worker.url, await _ask_holder(call, pool, worker)


async def _find_holder(
    responses: ResponseAffinity, registry: Registry, call: _Retrieval
) -> tuple[Pool, str, AiohttpSource]:
    """A tenant's own response this process does not know (routed by another process or replica,
    or before a restart): the first of the healthy workers of the pools that may hold it
    (`responses_search.pools_to_search`: the one its id names), in the registry's order, that
    answers a `GET` of it 200 (`responses_search.find_holder`) is remembered as its holder and
    asked the client's request; the gateway's 404 when every such worker says it does not hold
    it, a 503 with `Retry-After` when one could not tell (busy, unreachable, unhealthy)."""
    found = await find_holder(pools_to_search(responses.ids, registry, call.response_id), call.holds)
    if found is None:
        raise not_found(call.response_id)
    pool, worker = found.pool, found.worker
    responses.learn(call.response_id, call.tenant, pool.name, worker.worker_id, time.monotonic())
    return pool, worker.url, await _ask_holder(call, pool, worker)


async def _ask_holder(call: _Retrieval, pool: Pool, worker: Worker) -> AiohttpSource:
    """The holder's answer head to the client's request, asked under a place at it (held until
    the request ends: `_Retrieval.release`); its failures as the client's errors."""
    call.place = call.take_place(worker.url)
    try:
        return await call.ask(pool, worker.url)
    except TimeoutError:
        raise upstream_error(504, "the worker holding the response did not answer in time") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise _unreachable(exc) from None


async def _whole(source: AiohttpSource, timeouts: TimeoutsConfig) -> tuple[int, bytes]:
    """The worker's whole answer (bounded like any: `upstream.read_whole`). A read that fails
    once the answer has begun (too large, the process's answer budget, a broken connection) is
    mapped as the proxied routes map it (`failure.failure_of`); one that never got an answer is
    the holder being unreachable. A holder that is busy (503, 529) or refuses the gateway's
    credentials is answered as on the proxied routes (`failure.worker_status`): a busy one as a 503
    with its own `Retry-After` (`worker_overloaded` for its 529, which OpenAI clients do not know),
    though there is no other worker to try."""
    try:
        body = await source.read_all()
    except TimeoutError:
        source.close()
        raise upstream_error(504, "the worker holding the response did not answer in time") from None
    except TRANSPORT_ERRORS as exc:
        source.close()
        if isinstance(exc, UpstreamError) and exc.answered:
            raise failure_of(exc, Stage.ANSWER, timeouts).error() from None
        raise _unreachable(exc) from None
    except BaseException:
        source.close()
        raise
    source.release()
    if source.status in REFUSED_CREDENTIALS:  # the gateway's worker key, never the client's
        raise worker_status(source.status).error()
    if source.status in BUSY_STATUSES:
        raise worker_status(source.status, source.retry_hints).error()
    return source.status, body


def _unreachable(exc: BaseException) -> ApiError:
    """The holder did not answer: plain words for the client (the exception's class is not
    theirs to read)."""
    return upstream_error(502, "could not reach the worker holding the response")


def _is_event_stream(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
