"""Chat and completions response bodies and SSE chunks, in the shapes vLLM sends.

One request is a `LiveGroup`: every prompt times `n` choices, choice `index = prompt * n + c`.
Usage counts each prompt once (choice 0's cache hit) and every choice's output tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from loadtest.emulator.live import LiveGroup, LiveRequest
from loadtest.emulator.logprobs import chat_logprobs, completion_logprobs


def produced(live: LiveRequest) -> int:
    return min(live.produced, live.num_output_tokens)


def usage(group: LiveGroup) -> dict[str, Any]:
    firsts = group.first_of_each_prompt
    prompt = sum(live.num_prompt_tokens for live in firsts)
    completion = sum(produced(live) for live in group.lives)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(live.cached_tokens for live in firsts)},
    }


def tool_call_id(live: LiveRequest) -> str:
    return f"chatcmpl-tool-{live.request_id[:24]}"


def _logprobs(live: LiveRequest, start: int, stop: int) -> dict[str, Any] | None:
    top_k = live.gen.logprobs
    if top_k is None:
        return None
    entries = live.logprobs[start:stop]
    if live.gen.endpoint == "chat":
        return chat_logprobs(entries, top_k)
    return completion_logprobs(entries)


def _message(live: LiveRequest) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": live.answer.text, "tool_calls": []}
    call = live.gen.tool_call
    if call is not None:
        message["content"] = None
        message["tool_calls"] = [
            {
                "id": tool_call_id(live),
                "type": "function",
                "function": {"name": call.name, "arguments": live.answer.text},
            }
        ]
    return message


def _response(
    group: LiveGroup, object_name: str, answer: Callable[[LiveRequest], dict[str, Any]]
) -> dict[str, Any]:
    """The final body of a chat or completions request; `answer` gives a choice's own field."""
    choices = [
        {
            "index": live.index,
            **answer(live),
            "logprobs": _logprobs(live, 0, live.num_output_tokens),
            "finish_reason": live.finish_reason,
            "stop_reason": live.answer.stop_reason,  # vLLM's: the stop string that ended it
        }
        for live in group.lives
    ]
    return _with_kv_params(
        group,
        {
            "id": group.response_id,
            "object": object_name,
            "created": group.created,
            "model": group.gen.model,
            "choices": choices,
            "usage": usage(group),
        },
    )


def chat_response(group: LiveGroup) -> dict[str, Any]:
    return _response(group, "chat.completion", lambda live: {"message": _message(live)})


def completion_response(group: LiveGroup) -> dict[str, Any]:
    return _response(group, "text_completion", lambda live: {"text": live.answer.text})


def _with_kv_params(group: LiveGroup, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prefill answer names where its KV waits (`kv_transfer_params`, top level)."""
    if group.kv_transfer_params is not None:
        body["kv_transfer_params"] = group.kv_transfer_params
    return body


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _chunk(group: LiveGroup, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": group.response_id,
        "object": "chat.completion.chunk" if group.gen.endpoint == "chat" else "text_completion",
        "created": group.created,
        "model": group.gen.model,
        "choices": choices,
    }
    return body


def running_usage(live: LiveRequest, completion_tokens: int) -> dict[str, int]:
    """The usage vLLM puts on a chunk with `continuous_usage_stats`: the sequence's prompt and
    its tokens so far (no cache details)."""
    prompt = live.num_prompt_tokens
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _chat_delta(group: LiveGroup, live: LiveRequest, i: int) -> dict[str, Any]:
    piece = live.answer.deltas[i]
    call = live.gen.tool_call
    if call is None:
        delta: dict[str, Any] = {"content": piece}
        return {"role": "assistant", **delta} if i == 0 else delta
    tc: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
    if i == 0:
        tc = {
            "id": tool_call_id(live),
            "type": "function",
            "index": 0,
            "function": {"name": call.name, "arguments": piece},
        }
        return {"role": "assistant", "content": None, "tool_calls": [tc]}
    return {"tool_calls": [tc]}


def token_chunks(group: LiveGroup, live: LiveRequest, start: int, stop: int) -> list[bytes]:
    """SSE events for one sequence's output tokens `start..stop-1` (one event per token, as a
    real engine streams one token per step, with the text it streams: `Answer.deltas`); the first
    chat event also carries the role. With `continuous_usage_stats` each carries the usage so far;
    otherwise none has a `usage` key (vLLM leaves an unset usage out of its chunks). `stop_reason`
    is on every completions chunk and on the last chat chunk, as vLLM serializes them."""
    out: list[bytes] = []
    last = live.num_output_tokens - 1
    continuous = group.gen.continuous_usage
    for i in range(start, stop):
        choice: dict[str, Any] = {"index": live.index}
        completions = group.gen.endpoint == "completions"
        if completions:
            choice["text"] = live.answer.deltas[i]
        else:
            choice["delta"] = _chat_delta(group, live, i)
        choice["logprobs"] = _logprobs(live, i, i + 1)
        choice["finish_reason"] = live.finish_reason if i == last else None
        if completions or i == last:
            choice["stop_reason"] = live.answer.stop_reason if i == last else None
        chunk = _chunk(group, [choice])
        if continuous:
            chunk["usage"] = running_usage(live, i + 1)
        out.append(sse(chunk))
    return out


def final_chunks(group: LiveGroup) -> list[bytes]:
    out: list[bytes] = []
    if group.gen.include_usage:
        body = _chunk(group, [])
        body["usage"] = usage(group)
        out.append(sse(body))
    out.append(SSE_DONE)
    return out
