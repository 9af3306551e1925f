"""The emulated worker's HTTP app: probes, model and server info, metrics, and the route families.

Route families live in `routes_*.py` (OpenAI chat and completions, the Responses API, Anthropic
Messages, pooling, audio). The background step loop and the optional KV-event publisher are
owned by the app lifespan; handlers reach the worker through `web.worker_of(request)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from loadtest.emulator import (
    routes_aliases,
    routes_audio,
    routes_batch,
    routes_kv,
    routes_messages,
    routes_openai,
    routes_pooling,
    routes_reads,
    routes_responses,
    routes_scale_out,
)
from loadtest.emulator.auth import ApiKeyGuard
from loadtest.emulator.background import BackgroundResponses
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.kv_transfer import KvTransfers
from loadtest.emulator.live import KvEventSink
from loadtest.emulator.metrics import render_metrics
from loadtest.emulator.responses_api import ResponseStore
from loadtest.emulator.web import json_response as _json
from loadtest.emulator.worker import EmulatedWorker

ROUTE_FAMILIES: tuple[APIRouter, ...] = (
    routes_openai.router,
    routes_responses.router,
    routes_messages.router,
    routes_pooling.router,
    routes_audio.router,
    routes_kv.router,
    routes_aliases.router,
    routes_batch.router,
    routes_reads.router,
    routes_scale_out.router,
)
# SGLang's name for a server's role, as its routers read it from /server_info.
_DISAGGREGATION_MODE = {"prefill": "prefill", "decode": "decode", "mixed": "null"}


def _error(exc: ApiError) -> Response:
    return _json(exc.body(), exc.status)


def create_app(cfg: EmulatorConfig, sink_factory: Callable[[], KvEventSink | None] | None = None) -> FastAPI:
    """Build the ASGI app. `sink_factory` creates the KV-event publisher inside the lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        sink = sink_factory() if sink_factory is not None else None
        worker = EmulatedWorker(cfg, sink)
        kv = KvTransfers(worker)
        _app.state.worker = worker
        _app.state.kv = kv
        _app.state.response_store = ResponseStore()
        background = BackgroundResponses()
        _app.state.background_responses = background
        task = asyncio.create_task(worker.run(), name="engine-step-loop")
        try:
            yield
        finally:
            await background.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await kv.close()
            close = getattr(sink, "close", None)
            if close is not None:
                close()

    app = FastAPI(title="kvgate emulated vLLM worker", lifespan=lifespan, docs_url=None, redoc_url=None)

    def worker() -> EmulatedWorker:
        w: EmulatedWorker = app.state.worker
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

    def model_card() -> dict[str, Any]:
        return {
            "id": cfg.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": worker().max_model_len,
            "permission": [],
        }

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != cfg.model:
            raise ApiError.not_found(f"The model `{model_id}` does not exist.", "model")
        return _json(model_card())

    def _server_info() -> dict[str, Any]:
        w = worker()
        kv: KvTransfers = app.state.kv
        # No model_path / tokenizer_path on purpose: sglang-router would try to download it.
        return {
            "served_model_name": cfg.model,
            "tp_size": 1,
            "dp_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": _DISAGGREGATION_MODE[cfg.role],
            "role": cfg.role,
            "kv_engine_id": kv.engine_id,
            "disaggregation_bootstrap_port": cfg.bootstrap_port or cfg.port,
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
        text = render_metrics(
            cfg.model, w.stats(), w.block_size, w.latency, w.num_aborted, app.state.kv.stats, w.num_stopped
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not worker().reset_prefix_cache():
            raise ApiError(409, "prefix cache is in use by running requests", "ConflictError")
        return Response(status_code=200)

    for family in ROUTE_FAMILIES:
        app.include_router(family)
    if cfg.api_key:
        app.add_middleware(ApiKeyGuard, api_key=cfg.api_key)
    return app
