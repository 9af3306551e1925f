"""A worker that fails the way real ones do, for the reliability suite: one process, several ports,
one behaviour each. Every port passes its health checks (`GET /health`), as a broken worker
behind a live HTTP server does.

    python -m loadtest.abuse.faulty_worker --listen 31001:garbage --listen 31002:hang --listen 31003:ok

- `garbage`: 200 with a body that is not JSON (a stream: events that are not JSON), as from a
  proxy error page in front of the engine;
- `hang`: reads the request and never answers (a stream gets its head first), until the client
  hangs up or 60 s pass;
- `ok`: a short OpenAI-shaped answer, whole or streamed.

`GET /_stats` returns how many completions the port received.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

MODES = ("garbage", "hang", "ok")
HANG_LIMIT_S = 60.0
GARBAGE = b"<html><body>502 upstream proxy error</body></html>"


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    usage = {
        "prompt_tokens": 8,
        "completion_tokens": 2,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok ok"}, "finish_reason": "stop"}
    return {
        "id": "chatcmpl-faulty",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [choice],
        "usage": usage,
    }


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _stream_ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    base = {"id": "chatcmpl-faulty", "object": "chat.completion.chunk", "model": body.get("model")}
    for delta, finish in (
        ({"role": "assistant", "content": ""}, None),
        ({"content": "ok"}, None),
        ({}, "stop"),
    ):
        await resp.write(_event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
    usage = {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}
    await resp.write(_event({**base, "choices": [], "usage": usage}) + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _hold(request: web.Request) -> None:
    """Until the client closes the connection (or the limit passes)."""
    deadline = time.monotonic() + HANG_LIMIT_S
    while time.monotonic() < deadline:
        if request.transport is None or request.transport.is_closing():
            return
        await asyncio.sleep(0.05)


def make_app(mode: str) -> web.Application:
    received = 0

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def no_metrics(request: web.Request) -> web.Response:
        return web.Response(text="", content_type="text/plain")  # scraped, but nothing to report

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"requests": received})

    async def complete(request: web.Request) -> web.StreamResponse:
        nonlocal received
        body = orjson.loads(await request.read())
        received += 1
        stream = bool(body.get("stream"))
        if mode == "garbage":
            if not stream:
                return web.Response(body=GARBAGE, content_type="application/json")
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + GARBAGE + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if mode == "hang":
            if stream:
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(request)
                await _hold(request)
                return resp
            await _hold(request)
            return web.Response(status=503)
        if stream:
            return await _stream_ok(request, body)
        return web.Response(body=orjson.dumps(_answer(body)), content_type="application/json")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/_stats", stats)
    app.router.add_get("/metrics", no_metrics)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


async def serve(listens: Sequence[tuple[int, str]]) -> None:
    runners = []
    for port, mode in listens:
        runner = web.AppRunner(make_app(mode), handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def _listen(text: str) -> tuple[int, str]:
    port, _, mode = text.partition(":")
    if mode not in MODES or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected PORT:MODE with MODE one of {', '.join(MODES)}")
    return int(port), mode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.abuse.faulty_worker", description=__doc__)
    parser.add_argument("--listen", type=_listen, action="append", required=True, help="PORT:MODE")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
