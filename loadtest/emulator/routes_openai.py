"""OpenAI chat and completions, their render endpoints (vllm-router), tokenize and detokenize."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from loadtest.emulator import chat_bodies
from loadtest.emulator.base_request_id import base_request_id
from loadtest.emulator.errors import ApiError
from loadtest.emulator.live import LiveGroup
from loadtest.emulator.prompts import completion_prompt_ids
from loadtest.emulator.protocol import (
    GenerationRequest,
    parse_chat,
    parse_completions,
    render_chat_body,
)
from loadtest.emulator.routes_kv import transfers_of
from loadtest.emulator.web import json_response, read_json, token_batches, wait_finished, worker_of
from loadtest.emulator.worker import EmulatedWorker
from loadtest.engine.tokenizer import TokenizerError

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    if "messages" in body:
        ids = w.tokenizer.encode(render_chat_body(body))
    else:
        ids = completion_prompt_ids(body, w.tokenizer)
    token_strs = [w.tokenizer.decode([t]) for t in ids.tolist()] if body.get("return_token_strs") else None
    return json_response(
        {
            "count": len(ids),
            "max_model_len": w.max_model_len,
            "tokens": ids.tolist(),
            "token_strs": token_strs,
        }
    )


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    body = await read_json(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ApiError.bad_request("tokens must be a list of integers", "tokens")
    try:
        return json_response({"prompt": worker_of(request).tokenizer.decode(tokens)})
    except TokenizerError as exc:
        raise ApiError.bad_request(str(exc), "tokens") from exc


@router.post("/v1/chat/completions/render")
async def chat_render(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    gen = parse_chat(body, w.cfg, w.tokenizer)
    return json_response(gen.rendered(f"chatcmpl-{base_request_id(request, gen.request_id)}"))


@router.post("/v1/completions/render")
async def completions_render(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    gen = parse_completions(body, w.cfg, w.tokenizer)
    rid = f"cmpl-{base_request_id(request, gen.request_id)}"
    return json_response(
        [
            {"request_id": f"{rid}-{i}", "token_ids": ids.tolist(), "sampling_params": gen.echo_sampling,
             "model": gen.model}
            for i, ids in enumerate(gen.prompts)
        ]
    )  # fmt: skip


async def _generate(
    request: Request,
    body: dict[str, Any],
    gen: GenerationRequest,
    prefix: str,
    build: Callable[[LiveGroup], dict[str, Any]],
) -> Response:
    """Act on the request's prefill/decode fields (docs/pd.md), then run and answer it."""
    w = worker_of(request)
    prompt_param = "messages" if gen.endpoint == "chat" else "prompt"
    prepared = await transfers_of(request).prepare(body, gen, prompt_param)
    if prepared.failure is not None:
        if gen.stream:  # as vLLM: the stream opens, then carries the error
            return StreamingResponse(_error_stream(prepared.failure), media_type="text/event-stream")
        raise prepared.failure
    group = w.submit(
        prepared.gen,
        f"{prefix}-{base_request_id(request, gen.request_id)}",
        prepared.external_tokens,
        prepared.on_finish,
    )
    if prepared.ticket is not None:
        prepared.ticket.group = group
    if group.gen.stream:
        return StreamingResponse(_stream(w, group), media_type="text/event-stream")
    gone = await wait_finished(request, w, group)
    return gone if gone is not None else json_response(build(group))


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    gen = parse_chat(body, w.cfg, w.tokenizer)
    return await _generate(request, body, gen, "chatcmpl", chat_bodies.chat_response)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    gen = parse_completions(body, w.cfg, w.tokenizer)
    return await _generate(request, body, gen, "cmpl", chat_bodies.completion_response)


async def _error_stream(error: ApiError) -> AsyncIterator[bytes]:
    yield chat_bodies.sse(error.body())
    yield chat_bodies.SSE_DONE


async def _stream(w: EmulatedWorker, group: LiveGroup) -> AsyncIterator[bytes]:
    """SSE body: one event per generated token and choice as steps complete."""
    async with contextlib.aclosing(token_batches(w, group)) as batches:
        async for batch in batches:
            yield b"".join(
                chunk
                for live, start, stop in batch
                for chunk in chat_bodies.token_chunks(group, live, start, stop)
            )
    if group.failed:
        yield chat_bodies.sse(ApiError(500, "the emulated engine failed", "InternalServerError").body())
        yield chat_bodies.SSE_DONE
        return
    for chunk in chat_bodies.final_chunks(group):
        yield chunk
