"""OpenAI response bodies and SSE chunks, in the shapes vLLM sends."""

from __future__ import annotations

from typing import Any

import orjson

from loadtest.emulator.worker import LiveRequest


def usage(live: LiveRequest) -> dict[str, Any]:
    prompt = live.num_prompt_tokens
    completion = min(live.produced, live.num_output_tokens)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": live.cached_tokens},
    }


def finish_reason(live: LiveRequest) -> str:
    return "tool_calls" if live.gen.tool_call is not None else "length"


def _tool_call_id(live: LiveRequest) -> str:
    return "chatcmpl-tool-" + live.request_id.rsplit("-", 1)[-1][:24]


def chat_response(live: LiveRequest) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": live.answer.text, "tool_calls": []}
    call = live.gen.tool_call
    if call is not None:
        message["content"] = None
        message["tool_calls"] = [
            {
                "id": _tool_call_id(live),
                "type": "function",
                "function": {"name": call.name, "arguments": live.answer.text},
            }
        ]
    return {
        "id": live.request_id,
        "object": "chat.completion",
        "created": live.created,
        "model": live.gen.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(live)}],
        "usage": usage(live),
    }


def completion_response(live: LiveRequest) -> dict[str, Any]:
    return {
        "id": live.request_id,
        "object": "text_completion",
        "created": live.created,
        "model": live.gen.model,
        "choices": [
            {"index": 0, "text": live.answer.text, "logprobs": None, "finish_reason": finish_reason(live)}
        ],
        "usage": usage(live),
    }


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _chunk(live: LiveRequest, choices: list[dict[str, Any]], with_usage_null: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": live.request_id,
        "object": "chat.completion.chunk" if live.gen.endpoint == "chat" else "text_completion",
        "created": live.created,
        "model": live.gen.model,
        "choices": choices,
    }
    if with_usage_null:
        body["usage"] = None
    return body


def token_chunks(live: LiveRequest, start: int, stop: int) -> list[bytes]:
    """SSE events for output tokens `start..stop-1` (one event per token, as a real engine
    streams one token per step); the first chat event also carries the role."""
    out: list[bytes] = []
    pieces = live.answer.pieces
    last = live.num_output_tokens - 1
    include_usage = live.gen.include_usage
    call = live.gen.tool_call
    for i in range(start, stop):
        reason = finish_reason(live) if i == last else None
        if live.gen.endpoint == "completions":
            choice: dict[str, Any] = {
                "index": 0,
                "text": pieces[i],
                "logprobs": None,
                "finish_reason": reason,
            }
        elif call is not None:
            fn: dict[str, Any] = {"arguments": pieces[i]}
            tc: dict[str, Any] = {"index": 0, "function": fn}
            if i == 0:
                tc = {
                    "id": _tool_call_id(live),
                    "type": "function",
                    "index": 0,
                    "function": {"name": call.name, **fn},
                }
            delta: dict[str, Any] = {"tool_calls": [tc]}
            if i == 0:
                delta = {"role": "assistant", "content": None, **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            delta = {"content": pieces[i]}
            if i == 0:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        out.append(sse(_chunk(live, [choice], include_usage)))
    return out


def final_chunks(live: LiveRequest) -> list[bytes]:
    out: list[bytes] = []
    if live.gen.include_usage:
        body = _chunk(live, [], False)
        body["usage"] = usage(live)
        out.append(sse(body))
    out.append(SSE_DONE)
    return out
