"""The search for the holder of a stored response this gateway process does not know asks each
worker with the headers a proxied request to that worker carries: the gateway's request id, the
pool's key for its workers, the client headers the pool forwards and, while the gateway traces,
the request's trace context. Workers behind their own auth (they refuse a request without the
pool's key or a forwarded header with 401) are then found holding it, for a follow-up as for a
`GET` or `cancel`; the client's own key never reaches them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import build_app
from gateway.config import parse_config
from gateway.state import build_state
from gateway.tracing import RequestTracer
from prompt_normalizer.normalizer import NormalizerConfig
from tests.gateway.routes_rig import KEY, SECRET, Recording, config
from tests.gateway.routes_worker import Received, RoutesWorker
from tests.support.inprocess import every_worker_up
from tests.support.loopback import serve_app

WORKER_KEY = "sk-worker-5be1"
ORG = {"x-org-token": "org-7"}  # the pool forwards it, and its workers' auth wants it
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guarded(worker: RoutesWorker) -> web.Application:
    """`worker` behind its own auth: every API request without the pool's key and the org token
    is answered 401 (and recorded, as the worker records what it serves)."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        sent = (request.headers.get("authorization"), request.headers.get("x-org-token"))
        if request.path != "/health" and sent != (f"Bearer {WORKER_KEY}", ORG["x-org-token"]):
            headers = {k.lower(): v for k, v in request.headers.items()}
            worker.received.append(Received(request.path, headers, await request.read()))
            return web.json_response({"error": {"message": "unauthorized", "code": 401}}, status=401)
        return await handler(request)

    app = worker.app()
    app.middlewares.append(auth)
    return app


@contextlib.asynccontextmanager
async def guarded_workers(n: int) -> AsyncIterator[list[RoutesWorker]]:
    started = [RoutesWorker(f"w{i + 1}") for i in range(n)]
    runners: list[web.AppRunner] = []
    try:
        for worker in started:
            runner, port = await serve_app(guarded(worker))
            runners.append(runner)
            worker.url = f"http://127.0.0.1:{port}"
        yield started
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(
    fleet: list[RoutesWorker], key_file: Path, spans: InMemorySpanExporter | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """One gateway process (it knows only the ids it routed itself): its pool sends the workers'
    key and forwards the org token (and `traceparent`, which it withholds while tracing); with
    `spans` it traces into them."""
    pool = {"worker_api_key_file": str(key_file), "forward_headers": ["x-org-token", "traceparent"]}
    raw: dict[str, Any] = config([w.url for w in fleet], pool)
    if spans is not None:
        raw["tracing"] = {"enabled": True}
    state = build_state(parse_config(raw), SECRET, Recording(), NormalizerConfig())
    if spans is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        state.routing.tracer = RequestTracer(provider, "openai")  # `spans` outlives this gateway
    app = build_app(state)
    async with (
        app.fallback.router.lifespan_context(app.fallback),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
    ):
        await every_worker_up(state)
        yield client


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "worker-key"
    path.write_text(WORKER_KEY + "\n")
    return path


def probes(fleet: list[RoutesWorker], rid: str) -> list[Received]:
    return [r for w in fleet for r in w.received if r.path == f"/v1/responses/{rid}"]


async def create(client: httpx.AsyncClient) -> str:
    resp = await client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers={**KEY, **ORG})
    assert resp.status_code == 200, resp.text
    rid: str = resp.json()["id"]
    return rid


async def test_a_follow_up_finds_its_holder_behind_the_workers_auth(key_file: Path) -> None:
    async with guarded_workers(2) as fleet:
        async with gateway(fleet, key_file) as first:
            rids = [await create(first) for _ in range(2)]  # round_robin: one on each worker
        assert sorted(w.name for rid in rids for w in fleet if rid in w.responses) == ["w1", "w2"]
        for rid in rids:
            (holder,) = [w for w in fleet if rid in w.responses]
            async with gateway(fleet, key_file) as restarted:
                body = {"model": "m", "input": "next", "previous_response_id": rid}
                headers = {**KEY, **ORG, "traceparent": TRACEPARENT}
                resp = await restarted.post("/v1/responses", json=body, headers=headers)
                assert resp.status_code == 200, resp.text
            follow_up = holder.received[-1]
            assert follow_up.path == "/v1/responses" and follow_up.json()["previous_response_id"] == rid
            # Each worker asked was asked as the follow-up itself was sent: one request id, the
            # pool's key (never the client's), the headers the pool forwards.
            asked = probes(fleet, rid)
            assert asked and all(p.headers.get("x-request-id") for p in asked)
            for probe in asked:
                for name in ("x-request-id", "authorization", "x-org-token", "traceparent"):
                    assert probe.headers[name] == follow_up.headers[name], name
                assert "sk-t" not in str(probe.headers)


async def test_a_retrieve_and_a_cancel_find_their_holder_behind_the_workers_auth(key_file: Path) -> None:
    async with guarded_workers(2) as fleet:
        async with gateway(fleet, key_file) as first:
            rids = [await create(first) for _ in range(2)]
        async with gateway(fleet, key_file) as restarted:
            for rid in rids:
                got = await restarted.get(f"/v1/responses/{rid}", headers={**KEY, **ORG})
                assert got.status_code == 200 and got.json()["id"] == rid
            async with gateway(fleet, key_file) as another:
                for rid in rids:
                    cancel = await another.post(f"/v1/responses/{rid}/cancel", headers={**KEY, **ORG})
                    assert (cancel.status_code, cancel.json()["error"]["message"]) == (400, "cannot cancel")
        asked = [p for rid in rids for p in probes(fleet, rid)]
        assert asked and all(p.headers["authorization"] == f"Bearer {WORKER_KEY}" for p in asked)


async def test_while_tracing_the_search_travels_in_the_requests_trace(key_file: Path) -> None:
    spans = InMemorySpanExporter()
    async with guarded_workers(2) as fleet:
        async with gateway(fleet, key_file, spans) as first:
            rids = [await create(first) for _ in range(2)]
        spans.clear()
        async with gateway(fleet, key_file, spans) as restarted:
            for rid in rids:
                body = {"model": "m", "input": "next", "previous_response_id": rid}
                headers = {**KEY, **ORG, "traceparent": TRACEPARENT}
                resp = await restarted.post("/v1/responses", json=body, headers=headers)
                assert resp.status_code == 200, resp.text
        servers = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
        assert len(servers) == 2
        for rid, server in zip(rids, servers, strict=True):
            # The gateway's SERVER span of the follow-up, in the client's trace, is each probe's parent.
            assert f"{server.context.trace_id:032x}" == TRACE_ID
            parent = f"00-{TRACE_ID}-{server.context.span_id:016x}-01"
            asked = probes(fleet, rid)
            assert asked and all(p.headers["traceparent"] == parent for p in asked)
