"""vLLM 0.33's scale-out routes the emulator lacked: the render routes of Messages and Responses
(`/v1/messages/render`, `/v1/responses/render`: a body in, the tokens vLLM would generate from
out, nothing run), and the derender routes (`/v1/chat/completions/derender`,
`/v1/completions/derender`: a token-in, token-out answer back into a chat or completions one,
decoded without the engine; `stream` true is one chunk and the client-carried `stream_state`,
answered as one JSON object, never an event stream).

vLLM serves these only with `--enable-scale-out` (else 403); the emulator always serves them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loadtest.emulator.base_request_id import base_request_id
from loadtest.emulator.errors import ApiError
from loadtest.emulator.messages_api import parse_messages
from loadtest.emulator.protocol import check_model
from loadtest.emulator.responses_api import parse_responses
from loadtest.emulator.routes_responses import store_of
from loadtest.emulator.web import json_response, read_json, worker_of
from loadtest.engine.tokenizer import TokenizerError

router = APIRouter()


@router.post("/v1/messages/render")
async def messages_render(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    call = parse_messages(body, w.cfg, w.tokenizer, w.block_size)
    return json_response(call.gen.rendered(f"chatcmpl-{base_request_id(request, call.gen.request_id)}"))


@router.post("/v1/responses/render")
async def responses_render(request: Request) -> Response:
    body = await read_json(request)
    if body.get("previous_response_id") is not None:
        raise ApiError.bad_request(
            "previous_response_id is not supported by the stateless render endpoint.", "previous_response_id"
        )
    w = worker_of(request)
    call = parse_responses(body, w.cfg, w.tokenizer, store_of(request))
    return json_response(call.gen.rendered(call.gen.request_id or f"resp_{uuid.uuid4().hex}"))


def _decoded(request: Request, choice: Any, param: str) -> tuple[int, str, list[int], Any, Any]:
    """A generate choice's index, text, token ids, finish and stop reasons."""
    ids = choice.get("token_ids") if isinstance(choice, Mapping) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ApiError.bad_request("every choice needs its output token_ids", param)
    try:
        text = worker_of(request).tokenizer.decode(ids)
    except TokenizerError as exc:
        raise ApiError.bad_request(str(exc), param) from exc
    index = choice.get("index", 0)
    return index, text, ids, choice.get("finish_reason", "stop"), choice.get("stop_reason")


def _answer(answer: Any, param: str) -> tuple[Any, list[Any]]:
    """A generate answer's (or chunk's) `request_id` and choices."""
    choices = answer.get("choices") if isinstance(answer, Mapping) else None
    if not isinstance(answer, Mapping) or not isinstance(choices, list):
        raise ApiError.bad_request(f"{param} must be an output_mode 'tokens' answer", param)
    return answer.get("request_id"), choices


def _usage(prompt_tokens: Any, completion_tokens: int) -> dict[str, int]:
    prompt = prompt_tokens if isinstance(prompt_tokens, int) else 0
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _envelope(rid: object, kind: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def _chunk(
    request: Request, body: dict[str, Any], model: str, kind: str, content: Callable[[str], dict[str, Any]]
) -> Response:
    """A streamed derender: the worker's `generate_chunk` as one chunk of `kind`, each choice's text
    in the route's shape (`content`)."""
    rid, chunk_choices = _answer(body.get("generate_chunk"), "generate_chunk")
    choices = []
    for c in chunk_choices:
        index, text, _, finish, stop = _decoded(request, c, "generate_chunk")
        choices.append({"index": index, **content(text), "finish_reason": finish, "stop_reason": stop})
    return json_response(
        {"chunk": _envelope(rid, kind, model, choices), "stream_state": body.get("stream_state") or {}}
    )


@router.post("/v1/chat/completions/derender")
async def chat_derender(request: Request) -> Response:
    body = await read_json(request)
    model = check_model(body, worker_of(request).cfg)
    if body.get("stream") is True:
        return _chunk(
            request, body, model, "chat.completion.chunk", lambda text: {"delta": {"content": text}}
        )
    rid, generated = _answer(body.get("generate_response"), "generate_response")
    choices, completion = [], 0
    for c in generated:
        index, text, ids, finish, stop = _decoded(request, c, "generate_response")
        completion += len(ids)
        message = {"role": "assistant", "content": text, "tool_calls": []}
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop,
            }
        )
    return json_response(
        _envelope(rid, "chat.completion", model, choices)
        | {"usage": _usage(body.get("prompt_tokens"), completion)}
    )


@router.post("/v1/completions/derender")
async def completions_derender(request: Request) -> Response:
    body = await read_json(request)
    model = check_model(body, worker_of(request).cfg)
    if body.get("stream") is True:
        return _chunk(request, body, model, "text_completion", lambda text: {"text": text})
    answers = body.get("generate_responses")
    if not isinstance(answers, list) or not answers:
        raise ApiError.bad_request("generate_responses must be a non-empty list", "generate_responses")
    prompts = body.get("prompt_tokens")
    choices: list[dict[str, Any]] = []
    completion = 0
    first_id = None
    for generated in answers:
        rid, generated_choices = _answer(generated, "generate_responses")
        first_id = rid if first_id is None else first_id
        for c in generated_choices:
            _, text, ids, finish, stop = _decoded(request, c, "generate_responses")
            completion += len(ids)
            choices.append(
                {
                    "index": len(choices),
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": stop,
                }
            )
    prompt = sum(t for t in prompts if isinstance(t, int)) if isinstance(prompts, list) else 0
    return json_response(
        _envelope(first_id, "text_completion", model, choices) | {"usage": _usage(prompt, completion)}
    )
