"""A streamed retrieve resumed with `starting_after` (vLLM replays the stored events numbered after
it, then the new ones): when the stream breaks, the error event the gateway writes is numbered
after the last event the client got, as a fresh stream's is, so a client that resumes again from
the last `sequence_number` it saw gets no event twice."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from policies import make_policy
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app

SECRET = b"resumed-stream"
KEY = {"authorization": "Bearer sk"}
STORED_EVENTS = 6  # the worker holds events 0..5, then its stream breaks mid-event


def _event(seq: int, rid: str) -> bytes:
    kind = "response.created" if seq == 0 else "response.output_text.delta"
    data = {"type": kind, "sequence_number": seq, "response": {"id": rid}, "delta": "x"}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _create(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"id": body["request_id"], "object": "response", "status": "in_progress"})


async def _retrieve(request: web.Request) -> web.StreamResponse:
    rid = request.match_info["rid"]
    if request.query.get("stream") != "true":
        return web.json_response({"id": rid, "object": "response", "status": "in_progress"})
    after = request.query.get("starting_after")
    first = 0 if after is None else int(after) + 1
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for seq in range(first, STORED_EVENTS):
        await resp.write(_event(seq, rid))
    await resp.write(_event(STORED_EVENTS, rid)[:30])
    await resp.write_eof()
    return resp


@contextlib.asynccontextmanager
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/responses", _create)
    app.router.add_get("/v1/responses/{rid}", _retrieve)
    runner, port = await serve_app(app)
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{port}"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "scrape": {"enabled": False},
    }
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            yield gw.client
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("starting_after", [None, 0, 3])
async def test_the_error_event_is_numbered_after_the_last_event_relayed(starting_after: int | None) -> None:
    async with gateway() as client:
        created = await client.post(
            "/v1/responses", json={"model": "m", "input": "hi", "background": True}, headers=KEY
        )
        rid = created.json()["id"]
        params = (
            {"stream": "true"}
            if starting_after is None
            else {"stream": "true", "starting_after": str(starting_after)}
        )
        resp = await client.get(f"/v1/responses/{rid}", params=params, headers=KEY)
        events = [orjson.loads(e.split(b"data: ", 1)[1]) for e in resp.content.split(b"\n\n") if e]
        first = 0 if starting_after is None else starting_after + 1
        assert [e["sequence_number"] for e in events[:-1]] == list(range(first, STORED_EVENTS))
        assert events[-1]["type"] == "error"
        assert events[-1]["sequence_number"] == STORED_EVENTS
