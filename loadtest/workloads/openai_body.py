"""The OpenAI request a workload request becomes on the wire.

Trace and text prompts go to `/v1/completions` as raw text (no chat template, so the emulator's byte
tokenizer counts exactly the trace's tokens); chat prompts go to `/v1/chat/completions` with their
messages and tools. Every request streams and asks for usage, so the client sees the first token
and the worker's `cached_tokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loadtest.workloads.records import ChatMessage, ChatPrompt, WorkloadRequest
from loadtest.workloads.render import prompt_bytes


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """Path and JSON body of one request."""

    path: str
    body: dict[str, Any]


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in m.tool_calls
        ]
    return out


def chat_messages(prompt: ChatPrompt) -> list[dict[str, Any]]:
    return [_message(m) for m in prompt.messages]


def chat_tools(prompt: ChatPrompt) -> list[Any]:
    return [json.loads(t) for t in prompt.tools_json]


def openai_request(req: WorkloadRequest, model: str) -> OpenAIRequest:
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    p = req.prompt
    if isinstance(p, ChatPrompt):
        body = {**common, "messages": chat_messages(p)}
        if p.tools_json:
            body["tools"] = chat_tools(p)
        return OpenAIRequest("/v1/chat/completions", body)
    return OpenAIRequest("/v1/completions", {**common, "prompt": prompt_bytes(req).decode("ascii")})
