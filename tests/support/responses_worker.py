"""A vLLM-like worker that streams a stored response on retrieve, for the gateway's tests of
`GET /v1/responses/{id}?stream=true`:

    python -m tests.support.responses_worker PORT

`POST /v1/responses` answers a response (its id `resp_` + the body's `request_id`, or a fresh one).
`GET /v1/responses/{id}?stream=true` answers `text/event-stream`: `response.created` and
`response.in_progress` at once, then holds the stream until `POST /_release/{id}`, then sends
`response.completed` and ends; `POST /_die/{id}` instead makes it send half an event and drop the
connection, as a worker that dies mid-stream. A retrieve without `stream` answers the response as
JSON.
`GET /_log` returns the query strings and headers each retrieve came with, and the ids whose
stream the gateway closed before it ended.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import orjson
from aiohttp import web


class State:
    def __init__(self) -> None:
        self.releases: dict[str, asyncio.Event] = {}
        self.dying: set[str] = set()
        self.retrieves: list[dict[str, Any]] = []
        self.closed_early: list[str] = []


def _response(rid: str, status: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": 1, "model": "m", "status": status, "output": []}


def _event(kind: str, seq: int, rid: str, status: str) -> bytes:
    data = {"type": kind, "sequence_number": seq, "response": _response(rid, status)}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def make_app(state: State) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        data = [{"id": "m", "object": "model", "created": 1, "owned_by": "vllm", "max_model_len": 4096}]
        return web.json_response({"object": "list", "data": data})

    async def create(request: web.Request) -> web.Response:
        body = await request.json()
        rid = str(body.get("request_id") or f"resp_{uuid.uuid4().hex}")
        return web.json_response(_response(rid, "completed"))

    async def retrieve(request: web.Request) -> web.StreamResponse:
        rid = request.match_info["rid"]
        state.retrieves.append(
            {
                "id": rid,
                "query": request.query_string,
                "headers": {k.lower(): v for k, v in request.headers.items()},
            }
        )
        if request.query.get("stream") != "true":
            return web.json_response(_response(rid, "completed"))
        release = state.releases.setdefault(rid, asyncio.Event())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        ended = False
        try:
            await resp.write(_event("response.created", 0, rid, "in_progress"))
            await resp.write(_event("response.in_progress", 1, rid, "in_progress"))
            await release.wait()
            if rid in state.dying:
                await resp.write(_event("response.output_text.delta", 2, rid, "in_progress")[:40])
                assert request.transport is not None
                request.transport.abort()  # no end of the chunked body: the connection just drops
                return resp
            await resp.write(_event("response.completed", 2, rid, "completed"))
            await resp.write_eof()
            ended = True
        finally:
            if not ended:
                state.closed_early.append(rid)
        return resp

    async def release(request: web.Request) -> web.Response:
        state.releases.setdefault(request.match_info["rid"], asyncio.Event()).set()
        return web.json_response({})

    async def die(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        state.dying.add(rid)
        state.releases.setdefault(rid, asyncio.Event()).set()
        return web.json_response({})

    async def log(_: web.Request) -> web.Response:
        return web.json_response({"retrieves": state.retrieves, "closed_early": state.closed_early})

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/v1/models", models),
            web.post("/v1/responses", create),
            web.get("/v1/responses/{rid}", retrieve),
            web.post("/_release/{rid}", release),
            web.post("/_die/{rid}", die),
            web.get("/_log", log),
        ]
    )
    return app


if __name__ == "__main__":
    web.run_app(
        make_app(State()), host="127.0.0.1", port=int(sys.argv[1]), print=None, handler_cancellation=True
    )
