"""The emulator's chat template: messages (and tools) rendered to one prompt string.

    <|system|>\n{system content}<|end|>\n          (each message, in order)
    <|tools|>\n{tools as compact JSON}<|end|>\n     (after the first system message, or first)
    <|user|>\n{content}<|end|>\n
    <|assistant|>\n{content}<|end|>\n               (tool calls: <|tool_call|>{name} {arguments})
    <|tool|>\n{tool_call_id}\n{content}<|end|>\n
    <|assistant|>\n                                 (generation prompt, unless disabled)

Text content parts are concatenated. The assistant turn renders exactly as the generation prompt
followed by the generated text, so a next turn that repeats an answer shares its cached blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from loadtest.emulator.errors import ApiError

_ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: Any, where: str) -> str:
    """The text of a message's `content`: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError.bad_request(
                    "only text content parts are supported by the emulated worker", f"{where}.content[{i}]"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError.bad_request("content must be a string or a list of text parts", f"{where}.content")


def _tool_calls_text(calls: Any, where: str) -> str:
    if not isinstance(calls, list):
        raise ApiError.bad_request("tool_calls must be a list", f"{where}.tool_calls")
    out: list[str] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ApiError.bad_request("tool call needs function.name", f"{where}.tool_calls[{j}]")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = orjson.dumps(args).decode()
        out.append(f"<|tool_call|>{fn['name']} {args}")
    return "".join(out)


def render_chat(
    messages: Sequence[Any], tools: Sequence[Any] | None, add_generation_prompt: bool = True
) -> str:
    """Render a validated-as-we-go chat request; raises ApiError naming the bad message."""
    if not isinstance(messages, list) or not messages:
        raise ApiError.bad_request("messages must be a non-empty list", "messages")
    tools_block = ""
    if tools:
        tools_block = (
            "<|tools|>\n" + orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode() + "<|end|>\n"
        )
    out: list[str] = []
    tools_done = not tools_block
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ApiError.bad_request("each message must be an object", where)
        role = msg.get("role")
        if role not in _ROLES:
            raise ApiError.bad_request(f"role must be one of {', '.join(_ROLES)}", f"{where}.role")
        if not tools_done and role not in ("system", "developer"):
            out.append(tools_block)
            tools_done = True
        text = message_text(msg.get("content"), where)
        if role == "assistant" and msg.get("tool_calls"):
            text += _tool_calls_text(msg["tool_calls"], where)
        if role == "tool":
            call_id = msg.get("tool_call_id", "")
            text = f"{call_id}\n{text}"
        out.append(f"<|{role}|>\n{text}<|end|>\n")
        if not tools_done:
            out.append(tools_block)
            tools_done = True
    if not tools_done:
        out.append(tools_block)
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)
