"""A scripted in-process worker for the routes' tests: every route of a vLLM server, answers in
each API's shape (streamed or not), recording what it received; faults on demand."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tests.support.loopback import serve_app

PASS_THROUGH = (
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenize",
    "/detokenize",
    "/v1/messages/count_tokens",
)

# The routes vLLM's and SGLang's other APIs add, all answered like PASS_THROUGH, and the generating
# routes of their native APIs (answered like chat).
ENGINE_PATHS = (
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v2/embed",
    "/encode",
    "/v1/classify",
    "/v1/tokenize",
    "/v1/detokenize",
    "/invocations",
)
# vLLM 0.33's routes beyond those (a batch of chat completions, reads, render and derender), all
# answered like PASS_THROUGH.
VLLM_033_PATHS = (
    "/v1/chat/completions/batch",
    "/generative_scoring",
    "/v1/systemone",
    "/v1/decisions",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
)
GENERATING_PATHS = ("/v1/completions", "/generate", "/inference/v1/generate")

_ids = itertools.count(1)
_seq = itertools.count(1)


@dataclass
class Received:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    seq: int = 0  # order of arrival across every worker of the test

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class RoutesWorker:
    """`fault`: None, "die" (close a stream before its end), "error" (an error event mid-stream),
    "done_after_stop" (vLLM's stray `[DONE]` after `message_stop`)."""

    name: str
    status: int = 200
    error_body: Any = None
    fault: str | None = None
    text_answer: bool = False  # audio: answer text/plain
    received: list[Received] = field(default_factory=list)
    responses: dict[str, Any] = field(default_factory=dict)  # the worker's own response store
    response_id_suffix: str = ""  # appended to the ids of the responses it creates
    ignores_store: bool = False  # stores every response, whatever the request's `store` says
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", _health)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{rid}", self._get_response)
        app.router.add_post("/v1/responses/{rid}/cancel", self._cancel_response)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/audio/transcriptions", self._audio)
        app.router.add_post("/v1/audio/translations", self._audio)
        app.router.add_post("/v1/chat/completions", self._chat)
        for path in (*PASS_THROUGH, *ENGINE_PATHS, *VLLM_033_PATHS):
            app.router.add_post(path, self._json)
        for path in GENERATING_PATHS:
            app.router.add_post(path, self._chat)
        return app

    async def _record(self, request: web.Request) -> Received:
        headers = {k.lower(): v for k, v in request.headers.items()}
        got = Received(request.path, headers, await request.read(), next(_seq))
        self.received.append(got)
        return got

    def _refusal(self) -> web.Response | None:
        if self.status == 200:
            return None
        body = (
            self.error_body if self.error_body is not None else {"error": {"message": "refused", "code": 400}}
        )
        return web.json_response(body, status=self.status)

    async def _json(self, request: web.Request) -> web.Response:
        await self._record(request)
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        usage = {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}
        return web.json_response({"object": "list", "data": [], "served_by": self.name, "usage": usage})

    async def _chat(self, request: web.Request) -> web.Response:
        await self._record(request)
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        return web.json_response({"choices": [], "usage": usage})

    async def _audio(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.text_answer:
            return web.Response(text="a plain transcript", content_type="text/plain")
        return web.json_response({"text": "a transcript", "usage": {"type": "duration", "seconds": 1}})

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        got = await self._record(request)
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        body = got.json()
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            error = {"message": f"Response with id '{previous}' not found.", "type": "invalid_request_error",
                     "param": "response_id", "code": 404}  # fmt: skip
            return web.json_response({"error": error}, status=404)
        rid = (body.get("request_id") or f"resp_{self.name}_{next(_ids)}") + self.response_id_suffix
        usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 2,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 42}  # fmt: skip
        output = [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}]
        done = {"id": rid, "object": "response", "status": "completed", "error": None, "usage": usage,
                "output": output}  # fmt: skip
        if self.ignores_store or body.get("store", True):
            self.responses[rid] = done
        if not body.get("stream"):
            return web.json_response(done)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        start = {**done, "status": "in_progress", "usage": None, "output": []}
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": start}),
            ("response.in_progress", {"response": start}),
            ("response.output_text.delta", {"delta": "h", "item_id": "m1"}),
            ("response.output_text.delta", {"delta": "i", "item_id": "m1"}),
            ("response.completed", {"response": done}),
        ]
        for n, (kind, data) in enumerate(events):
            if self.fault == "die" and kind == "response.completed":
                break
            if self.fault == "error" and n == 3:
                kind, data = "error", {"code": "engine_dead", "message": "engine failed", "param": None}
            payload = orjson.dumps({"type": kind, "sequence_number": n, **data})
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def _get_response(self, request: web.Request) -> web.Response:
        await self._record(request)
        stored = self.responses.get(request.match_info["rid"])
        if stored is None:
            error = {"message": "Response not found.", "type": "invalid_request_error", "code": 404}
            return web.json_response({"error": error}, status=404)
        return web.json_response(stored)

    async def _cancel_response(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"error": {"message": "cannot cancel", "code": 400}}, status=400)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        got = await self._record(request)
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        body = got.json()
        usage = {
            "input_tokens": 4,
            "cache_read_input_tokens": 32,
            "cache_creation_input_tokens": 0,
            "output_tokens": 2,
        }
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model"),
                   "content": [{"type": "text", "text": "hi"}], "stop_reason": "max_tokens",
                   "usage": usage}  # fmt: skip
        if not body.get("stream"):
            return web.json_response(message)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        start_usage = {**usage, "output_tokens": 0}
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"message": {**message, "content": [], "usage": start_usage}}),
            ("ping", {}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
            ("content_block_stop", {"index": 0}),
            ("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}}),
            ("message_stop", {}),
        ]
        for n, (kind, data) in enumerate(events):
            if self.fault == "die" and kind == "message_delta":
                break
            if self.fault == "error" and n == 3:
                kind, data = "error", {"error": {"type": "overloaded_error", "message": "busy"}}
            await resp.write(
                b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"
            )
            await asyncio.sleep(0)
        if self.fault == "done_after_stop":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def start(worker: RoutesWorker) -> web.AppRunner:
    """Serve `worker` on a free loopback port (its `url` is set); the caller cleans the runner up."""
    runner, port = await serve_app(worker.app())
    worker.url = f"http://127.0.0.1:{port}"
    return runner
