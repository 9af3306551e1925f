"""A small fault-injecting OpenAI-style worker for the gateway's end-to-end tests.

One process serves several ports, each with its own behaviour:

    python -m tests.e2e.fake_worker --listen 9001:ok --listen 9002:error500 ...

modes: ok (answers), error500 (500 before the first byte), once500 (500 the first time any once500
port of the process sees a request id, an answer after that), die (streams two chunks, then drops the
connection), slow (streams one chunk every 50 ms for 10 s and records a client cancel), hang
(answers nothing for 30 s; a stream gets its head first, as from an engine that is stuck; the
gateway hanging up is recorded as a cancel), tail (streams a chunk every 40 ms for ~0.4 s, then
`[DONE]`, then ends the chunked body 30 ms later), garbage (answers 200 with a body that is not
JSON, or a stream whose events are not JSON), reject400 (a 400 in vLLM's error shape, naming `max_tokens`),
streamerr400 / streamerr500 (stream two chunks, then an error event quoting the prompt, in vLLM's
nested shape with `code` 400 / its older flat shape with `code` 500, then keep streaming for 10 s),
big (a non-streamed chat answer of `max_tokens` KiB of content, chunked: all but its last bytes at
once, the rest when the process is released: GET /_hold holds every big answer's end, GET /_release
lets them end; released at start; a gateway closing the connection meanwhile is recorded as a cancel).
GET /_log on any port returns what that port received (request id, body, headers, traceparent), saw (cancels,
named by the body's `user` field when the test set one, else by the request id the gateway sent),
how many distinct connections its completions came on, and the method, path, `Authorization` and
`User-Agent` of every other request (health checks, metric scrapes; the last 200).
POST /v1/messages is served as chat completions are: only its failure modes are meant for it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

MODES = (
    "ok",
    "error500",
    "once500",
    "die",
    "slow",
    "hang",
    "tail",
    "garbage",
    "reject400",
    "streamerr400",
    "streamerr500",
    "big",
)
# Request ids some once500 port has failed already (shared by all ports of the process).
FAILED_ONCE: set[str] = set()
# Set while big answers may end (GET /_release), cleared by GET /_hold; shared by all ports.
RELEASED = asyncio.Event()
RELEASED.set()


class Port:
    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode
        self.requests: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.seen_prompts: list[str] = []
        self.peers: set[Any] = set()  # the gateway's end of each connection a completion came on
        self.others: list[dict[str, Any]] = []  # method, path, authorization of other requests


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return orjson.dumps(body["messages"]).decode()
    return str(body.get("prompt"))


def _cached(port: Port, text: str, salt: Any) -> int:
    # Longest common prefix with an earlier prompt of the same salt, in whole 16-byte blocks.
    keyed = f"{salt}\x00{text}"
    best = 0
    for earlier in port.seen_prompts:
        n = 0
        for a, b in zip(earlier, keyed, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    port.seen_prompts.append(keyed)
    del port.seen_prompts[:-64]
    return max(0, best - len(str(salt)) - 1) // 16 * 16


def _answer(body: dict[str, Any], port: Port) -> tuple[dict[str, Any], str | None]:
    """The assistant message (content or a tool call) and its finish reason."""
    tools = body.get("tools")
    messages = body.get("messages") or []
    if tools and body.get("tool_choice") != "none" and messages and messages[-1].get("role") == "user":
        name = tools[0]["function"]["name"]
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": name, "arguments": '{"city": "Paris"}'},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {"role": "assistant", "content": f"[{port.name}] hello from the fake worker"}, "stop"


async def _until_closed(request: web.Request, port: Port, tag: str, limit_s: float) -> None:
    """Wait up to `limit_s`; record `tag` as cancelled if the gateway closes the connection."""
    for _ in range(int(limit_s / 0.05)):
        if request.transport is None or request.transport.is_closing():
            port.cancelled.append(tag)
            return
        await asyncio.sleep(0.05)


async def _big(request: web.Request, port: Port, tag: str, answer: dict[str, Any]) -> web.StreamResponse:
    """`answer` with `max_tokens` KiB of content, its end held while the process is on hold."""
    size = int(answer.pop("kib")) * 1024
    answer["choices"][0]["message"]["content"] = "x" * size
    data = orjson.dumps(answer)
    resp = web.StreamResponse(headers={"content-type": "application/json"})
    await resp.prepare(request)
    await resp.write(data[:-2])
    for _ in range(600):
        if request.transport is None or request.transport.is_closing():
            port.cancelled.append(tag)
            return resp
        if RELEASED.is_set():
            break
        await asyncio.sleep(0.05)
    try:
        await resp.write(data[-2:])
        await resp.write_eof()
    except ConnectionError:  # the gateway hung up between the last look and the release
        port.cancelled.append(tag)
    return resp


def make_app(port: Port) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def log(request: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(
                {
                    "requests": port.requests,
                    "cancelled": port.cancelled,
                    "connections": len(port.peers),
                    "others": port.others,
                }
            ),
            content_type="application/json",
        )

    async def hold(request: web.Request) -> web.Response:
        RELEASED.clear()
        return web.Response(text="held")

    async def release(request: web.Request) -> web.Response:
        RELEASED.set()
        return web.Response(text="released")

    async def infer(request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        rid = request.headers.get("x-request-id", "")
        headers = {name.lower(): value for name, value in request.headers.items()}
        port.requests.append(
            {
                "request_id": rid,
                "body": body,
                "path": request.path,
                "headers": headers,
                "traceparent": request.headers.get("traceparent"),
            }
        )
        tag = body.get("user") or rid
        if request.transport is not None:
            port.peers.add(request.transport.get_extra_info("peername"))
        if port.mode == "hang":
            if not body.get("stream"):
                await _until_closed(request, port, tag, 30.0)
                return web.Response(status=503)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await _until_closed(request, port, tag, 30.0)
            return resp
        if port.mode == "garbage":
            if body.get("stream"):
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"data: <html>upstream proxy error</html>\n\ndata: [DONE]\n\n")
                await resp.write_eof()
                return resp
            return web.Response(body=b"<html>upstream proxy error</html>", content_type="application/json")
        if port.mode == "once500" and rid not in FAILED_ONCE:
            FAILED_ONCE.add(rid)
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        if port.mode == "reject400":
            # vLLM's shape: a class name for `type`, the status as an integer `code`.
            error = {
                "message": "max_tokens is too large",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
            return web.json_response({"error": error}, status=400)
        if port.mode == "error500":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        chat = request.path.endswith("chat/completions")
        text = _prompt_text(body)
        prompt_tokens = len(text.encode())
        cached = _cached(port, text, body.get("cache_salt"))
        message, finish = _answer(body, port)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 7,
            "total_tokens": prompt_tokens + 7,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        base = {"id": f"cmpl-{rid}", "created": int(time.time()), "model": body.get("model")}
        if port.mode == "big" and chat and not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None}
            out = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            return await _big(request, port, tag, {**out, "kib": body.get("max_tokens") or 1})
        if not body.get("stream"):
            if port.mode == "slow":
                # A long non-streamed generation: notice the gateway closing the connection.
                for _ in range(200):
                    if request.transport is None or request.transport.is_closing():
                        port.cancelled.append(tag)
                        return web.Response(status=499)
                    await asyncio.sleep(0.05)
            if chat:
                choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
                out = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            else:
                choice = {"index": 0, "text": message["content"], "finish_reason": finish, "logprobs": None}
                out = {**base, "object": "text_completion", "choices": [choice], "usage": usage}
            return web.Response(body=orjson.dumps(out), content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        def delta_chunk(delta: dict[str, Any], fin: str | None) -> bytes:
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": fin, "logprobs": None}
            else:
                choice = {
                    "index": 0,
                    "text": delta.get("content") or "",
                    "finish_reason": fin,
                    "logprobs": None,
                }
            return event({**base, "object": obj, "choices": [choice], "usage": None})

        try:
            if port.mode.startswith("streamerr"):
                await resp.write(delta_chunk({"role": "assistant", "content": ""}, None))
                await resp.write(delta_chunk({"content": "partial "}, None))
                message_text = f"cannot continue after {text[:200]}"
                if port.mode == "streamerr400":
                    error = {
                        "object": "error",
                        "message": message_text,
                        "type": "BadRequestError",
                        "param": "messages",
                        "code": 400,
                        "engine_trace": "EngineCore_0 step 17",
                    }
                    await resp.write(event({"error": error}))
                else:
                    await resp.write(
                        event(
                            {
                                "object": "error",
                                "message": message_text,
                                "type": "InternalServerError",
                                "code": 500,
                            }
                        )
                    )
                # A worker that keeps talking after its error: the gateway must not wait for it.
                for i in range(200):
                    await resp.write(delta_chunk({"content": f"after{i} "}, None))
                    await asyncio.sleep(0.05)
                port.cancelled.append(f"finished:{tag}")
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if port.mode == "slow":
                for i in range(200):
                    await resp.write(delta_chunk({"content": f"t{i} "}, None))
                    await asyncio.sleep(0.05)
                port.cancelled.append(f"finished:{tag}")
                return resp
            if port.mode == "tail":
                for i in range(10):
                    await resp.write(delta_chunk({"content": f"t{i} "}, None))
                    await asyncio.sleep(0.04)
                await resp.write(delta_chunk({}, "stop") + b"data: [DONE]\n\n")
                # The end of the chunked body comes a moment after [DONE], as it may from a worker.
                await asyncio.sleep(0.03)
                await resp.write_eof()
                return resp
            if "tool_calls" in message:
                call = message["tool_calls"][0]
                await resp.write(
                    delta_chunk({"role": "assistant", "tool_calls": [{"index": 0, **call}]}, None)
                )
            else:
                await resp.write(delta_chunk({"role": "assistant", "content": ""}, None))
                for word in message["content"].split(" "):
                    await resp.write(delta_chunk({"content": word + " "}, None))
                    if port.mode == "die":
                        await asyncio.sleep(0.01)
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
            await resp.write(delta_chunk({}, finish))
            options = body.get("stream_options") or {}
            if options.get("include_usage"):
                # vLLM quirk the gateway must fix: a usage-only chunk with "choices": null.
                await resp.write(event({**base, "object": obj, "choices": None, "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            port.cancelled.append(tag)
            raise
        return resp

    @web.middleware
    async def note_others(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "POST" and request.path != "/_log":
            seen = {"method": request.method, "path": request.path}
            seen["user_agent"] = request.headers.get("user-agent", "")
            port.others.append({**seen, "authorization": request.headers.get("authorization")})
            del port.others[:-200]
        response: web.StreamResponse = await handler(request)
        return response

    app = web.Application(middlewares=[note_others])
    app.router.add_get("/health", health)
    app.router.add_get("/_log", log)
    app.router.add_get("/_hold", hold)
    app.router.add_get("/_release", release)
    app.router.add_post("/v1/chat/completions", infer)
    app.router.add_post("/v1/completions", infer)
    app.router.add_post("/v1/messages", infer)
    return app


async def main(listens: list[str]) -> None:
    runners = []
    for spec in listens:
        port_s, _, mode = spec.partition(":")
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; known: {MODES}")
        runner = web.AppRunner(make_app(Port(f"{mode}-{port_s}", mode)), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(port_s)).start()
        runners.append(runner)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", action="append", required=True, help="PORT:MODE")
    asyncio.run(main(parser.parse_args().listen))
