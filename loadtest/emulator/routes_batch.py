"""vLLM 0.33's batch of chat completions, `POST /v1/chat/completions/batch`: `messages` is a list
of conversations, each rendered and decoded once (no `n`, no beam search, no tools, no stream: a
`stream` field is ignored as an extra one), answered together as one `chat.completion` whose
choice `i` answers conversation `i` and whose usage sums them all. Its id is
`chatcmpl-<base id>` (`base_request_id`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loadtest.emulator import chat_bodies
from loadtest.emulator.base_request_id import base_request_id
from loadtest.emulator.errors import ApiError
from loadtest.emulator.protocol import parse_chat
from loadtest.emulator.web import json_response, read_json, wait_finished, worker_of

router = APIRouter()


def _conversations(body: dict[str, Any]) -> list[list[Any]]:
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations:
        raise ApiError.bad_request("messages must be a non-empty list of conversations", "messages")
    for conversation in conversations:
        if not isinstance(conversation, list) or not conversation:
            raise ApiError.bad_request("every conversation must be a non-empty list of messages", "messages")
    return conversations


@router.post("/v1/chat/completions/batch")
async def chat_batch(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    if body.get("use_beam_search"):
        raise ApiError.bad_request(
            "Batch chat completions do not support beam search. Please set `use_beam_search` to False.",
            "use_beam_search",
        )
    if body.get("n", 1) not in (None, 1):
        raise ApiError.bad_request("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
    # One chat request per conversation, as vLLM's `to_chat_completion_request` makes them.
    single = {name: value for name, value in body.items() if name not in ("messages", "stream", "tools")}
    gens = [parse_chat({**single, "messages": c}, w.cfg, w.tokenizer) for c in _conversations(body)]
    gen = dataclasses.replace(
        gens[0], prompts=tuple(g.prompt_ids for g in gens), stream=False, include_usage=True, n=1
    )
    group = w.submit(gen, f"chatcmpl-{base_request_id(request, gen.request_id)}")
    gone = await wait_finished(request, w, group)
    return gone if gone is not None else json_response(chat_bodies.chat_response(group))
