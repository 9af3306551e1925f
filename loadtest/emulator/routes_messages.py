"""`POST /v1/messages` (plain and streamed) and `POST /v1/messages/count_tokens`, Anthropic-shaped.

Errors on these routes are Anthropic's envelope `{"type": "error", "error": {"type", "message"}}`,
except a body vLLM's request model refuses (`RequestValidationError`): vLLM answers that before the
route runs, in the OpenAI envelope.
A stream sends, once the first token is ready (so its usage knows the cache hit),
`message_start`; with the first text `content_block_start`, then one `content_block_delta` per
token that streams text (`text_delta`, or `input_json_delta` for a tool call); and finally
`content_block_stop`, `message_delta` (stop reason, stop sequence and the full usage) and
`message_stop`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from loadtest.emulator.errors import ApiError, RequestValidationError
from loadtest.emulator.live import LiveGroup
from loadtest.emulator.messages_api import (
    MessagesCall,
    content_block,
    count_tokens_body,
    error_body,
    message_body,
    parse_messages,
    stop_reason,
    stop_sequence,
    usage,
)
from loadtest.emulator.web import (
    answer_steps,
    json_response,
    named_event,
    read_json,
    wait_finished,
    worker_of,
)
from loadtest.emulator.worker import EmulatedWorker

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    try:
        body = await read_json(request)
        w = worker_of(request)
        call = parse_messages(body, w.cfg, w.tokenizer, w.block_size)
        group = w.submit(call.gen, call.message_id)
        if call.gen.stream:
            return StreamingResponse(_stream(w, call, group), media_type="text/event-stream")
        gone = await wait_finished(request, w, group)
        if gone is not None:
            return gone
        try:
            return json_response(message_body(call, group, done=True))
        except orjson.JSONDecodeError as exc:
            # A named call's arguments that a stop string cut: vLLM's json.loads of them fails and
            # its route answers its catch-all 500.
            return json_response(
                {"type": "error", "error": {"type": "internal_error", "message": str(exc)}}, 500
            )
    except RequestValidationError as exc:  # refused by vLLM's request model: its OpenAI-shaped 400
        return json_response(exc.body(), exc.status)
    except ApiError as exc:
        return json_response(error_body(exc), exc.status)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    try:
        body = await read_json(request)
        w = worker_of(request)
        call = parse_messages(count_tokens_body(body), w.cfg, w.tokenizer, w.block_size)
        return json_response({"input_tokens": len(call.gen.prompt_ids)})
    except RequestValidationError as exc:
        return json_response(exc.body(), exc.status)
    except ApiError as exc:
        return json_response(error_body(exc), exc.status)


async def _stream(w: EmulatedWorker, call: MessagesCall, group: LiveGroup) -> AsyncIterator[bytes]:
    """As vLLM converts a chat stream: the block starts with the first text (empty deltas,
    such as those a stop string holds back, send nothing), so an empty answer has no block."""
    is_call = group.gen.tool_call is not None
    started = False
    async with contextlib.aclosing(answer_steps(w, group)) as steps:
        async for first, pieces in steps:
            out: list[bytes] = []
            if first:
                out.append(named_event("message_start", {"message": message_body(call, group, done=False)}))
            for piece in pieces:
                if not piece:
                    continue
                if not started:
                    block = content_block(group, "", False)
                    out.append(named_event("content_block_start", {"index": 0, "content_block": block}))
                    started = True
                delta = (
                    {"type": "input_json_delta", "partial_json": piece}
                    if is_call
                    else {"type": "text_delta", "text": piece}
                )
                out.append(named_event("content_block_delta", {"index": 0, "delta": delta}))
            yield b"".join(out)
    if group.failed:
        yield named_event("error", {"error": {"type": "api_error", "message": "the emulated engine failed"}})
        return
    if started:
        yield named_event("content_block_stop", {"index": 0})
    end = {"stop_reason": stop_reason(group), "stop_sequence": stop_sequence(group)}
    yield named_event("message_delta", {"delta": end, "usage": usage(call, group)})
    yield named_event("message_stop", {})
