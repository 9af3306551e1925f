"""The emulated worker's HTTP surface (vLLM's OpenAI server routes plus the SGLang-router probes).

The background step loop and the optional KV-event publisher are owned by the app lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loadtest.emulator import chat_bodies
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.metrics import render_metrics
from loadtest.emulator.protocol import (
    completion_prompt_ids,
    parse_chat,
    parse_completions,
    render_chat_body,
)
from loadtest.emulator.worker import EmulatedWorker, KvEventSink, LiveRequest
from loadtest.engine.tokenizer import TokenizerError

MAX_BODY_BYTES = 64 * 1024 * 1024
DISCONNECT_POLL_S = 0.5


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _error(exc: ApiError) -> Response:
    return _json(exc.body(), exc.status)


async def _read_json(request: Request) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes", "BadRequestError")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes", "BadRequestError")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError.bad_request(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError.bad_request("request body must be a JSON object")
    return body


def create_app(cfg: EmulatorConfig, sink_factory: Callable[[], KvEventSink | None] | None = None) -> FastAPI:
    """Build the ASGI app. `sink_factory` creates the KV-event publisher inside the lifespan."""
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        sink = sink_factory() if sink_factory is not None else None
        worker = EmulatedWorker(cfg, sink)
        state["worker"] = worker
        task = asyncio.create_task(worker.run(), name="engine-step-loop")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            close = getattr(sink, "close", None)
            if close is not None:
                close()

    app = FastAPI(title="kvgate emulated vLLM worker", lifespan=lifespan, docs_url=None, redoc_url=None)

    def worker() -> EmulatedWorker:
        w: EmulatedWorker = state["worker"]
        return w

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> Response:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _error(ApiError(exc.status_code, str(exc.detail), kind))

    # ---------------------------------------------------------------- probes and info

    @app.get("/health")
    @app.get("/health_generate")
    @app.get("/ping")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": "kvgate-emulator"})

    @app.get("/v1/models")
    async def models() -> Response:
        w = worker()
        card = {
            "id": cfg.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": w.max_model_len,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    def _server_info() -> dict[str, Any]:
        w = worker()
        # No model_path / tokenizer_path on purpose: sglang-router would try to download it.
        return {
            "served_model_name": cfg.model,
            "tp_size": 1,
            "dp_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "block_size": w.block_size,
            "num_gpu_blocks": w.num_blocks,
            "max_model_len": w.max_model_len,
            "emulator_profile": w.profile.name,
            "time_scale": cfg.time_scale,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        return _json(_server_info())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        return _json(
            {
                "served_model_name": cfg.model,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "is_generation": True,
            }
        )

    @app.get("/get_load")
    async def get_load() -> Response:
        s = worker().stats()
        used_tokens = s.num_used_blocks * worker().block_size
        return _json(
            [{"dp_rank": 0, "num_reqs": s.num_running + s.num_waiting, "num_waiting_reqs": s.num_waiting,
              "num_tokens": used_tokens}]
        )  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        w = worker()
        text = render_metrics(cfg.model, w.stats(), w.block_size, w.latency, w.num_aborted)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not worker().reset_prefix_cache():
            raise ApiError(409, "prefix cache is in use by running requests", "ConflictError")
        return Response(status_code=200)

    # ---------------------------------------------------------------- tokenizer and render

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _read_json(request)
        w = worker()
        if "messages" in body:
            ids = w.tokenizer.encode(render_chat_body(body))
        else:
            ids = completion_prompt_ids(body, w.tokenizer)
        return _json({"count": len(ids), "max_model_len": w.max_model_len, "tokens": ids.tolist()})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _read_json(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError.bad_request("tokens must be a list of integers", "tokens")
        try:
            return _json({"prompt": worker().tokenizer.decode(tokens)})
        except TokenizerError as exc:
            raise ApiError.bad_request(str(exc), "tokens") from exc

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> Response:
        body = await _read_json(request)
        w = worker()
        gen = parse_chat(body, cfg, w.tokenizer)
        return _json(
            {
                "request_id": f"chatcmpl-{time.monotonic_ns():x}",
                "token_ids": gen.prompt_ids.tolist(),
                "sampling_params": gen.echo_sampling,
                "model": gen.model,
                "features": None,
            }
        )

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        body = await _read_json(request)
        w = worker()
        gen = parse_completions(body, cfg, w.tokenizer)
        return _json(
            [
                {
                    "request_id": f"cmpl-{time.monotonic_ns():x}",
                    "token_ids": gen.prompt_ids.tolist(),
                    "sampling_params": gen.echo_sampling,
                    "model": gen.model,
                }
            ]
        )

    # ---------------------------------------------------------------- generation

    async def _generate(
        request: Request, live: LiveRequest, build: Callable[[LiveRequest], dict[str, Any]]
    ) -> Response:
        w = worker()
        if live.gen.stream:
            return StreamingResponse(_stream(w, live), media_type="text/event-stream")
        try:
            # Tokens wake this loop every step; look for a client disconnect every poll period.
            next_check_s = time.monotonic() + DISCONNECT_POLL_S
            while not live.finished:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(live.wait(), timeout=DISCONNECT_POLL_S)
                if time.monotonic() >= next_check_s:
                    next_check_s = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        w.abort(live)
                        return Response(status_code=499)
        finally:
            w.abort(live)  # no-op once finished; frees blocks if the handler is cancelled
        if live.failed:
            raise ApiError(
                500, "the emulated engine failed while running this request", "InternalServerError"
            )
        return _json(build(live))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _read_json(request)
        w = worker()
        live = w.submit(parse_chat(body, cfg, w.tokenizer))
        return await _generate(request, live, chat_bodies.chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _read_json(request)
        w = worker()
        live = w.submit(parse_completions(body, cfg, w.tokenizer))
        return await _generate(request, live, chat_bodies.completion_response)

    return app


async def _stream(w: EmulatedWorker, live: LiveRequest) -> AsyncIterator[bytes]:
    """SSE body: one event per generated token as steps complete; abort on client disconnect."""
    sent = 0
    try:
        while True:
            ready = min(live.produced, live.num_output_tokens)
            if ready > sent:  # tokens of several steps (a slow reader) go out in one write
                yield b"".join(chat_bodies.token_chunks(live, sent, ready))
                sent = ready
            if live.finished:
                break
            await live.wait()
        if live.failed:
            yield chat_bodies.sse(ApiError(500, "the emulated engine failed", "InternalServerError").body())
            yield chat_bodies.SSE_DONE
            return
        for chunk in chat_bodies.final_chunks(live):
            yield chunk
    finally:
        w.abort(live)
