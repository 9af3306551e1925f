"""OpenAI Responses requests as the chat request vLLM renders for them.

    instructions              -> a system message (immutable under the default zone rules)
    input: "text"             -> one user message
    input: [items]            -> message items (their role; text parts as text, other parts kept
                                 for the media digest), function_call -> an assistant tool call,
                                 function_call_output -> a tool message; reasoning items are not
                                 part of the prompt; any other item is keyed by its JSON
    tools (function)          -> chat tools; other tool types are keyed as they are

A follow-up (`previous_response_id`) continues a conversation that only the worker holding it
knows: its prompt is the instructions, then the stored turns, then the new input. Only the part
the gateway can see at its true position is keyed: the instructions and tools. The rest counts
for nothing here and the worker reports the real size in its usage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from prompt_normalizer.converted import ConvertedChat
from prompt_normalizer.errors import NormalizerError

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})


def _parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise NormalizerError("content must be a string or an array of parts", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if not isinstance(kind, str):
            raise NormalizerError("each content part needs a 'type'", param=f"{where}[{j}]")
        text = part.get("text", part.get("refusal"))
        if kind in _TEXT_PARTS:
            if not isinstance(text, str):
                raise NormalizerError("text part needs a string 'text'", param=f"{where}[{j}].text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append(dict(part))  # keyed by its digest, like any media part
    return parts


def _item(item: Any, where: str) -> dict[str, Any] | None:
    """One input item as a chat message (None: not part of the prompt)."""
    if not isinstance(item, Mapping):
        raise NormalizerError("each input item must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise NormalizerError(
                "message 'role' must be user, system, developer or assistant", param=f"{where}.role"
            )
        return {"role": role, "content": _parts(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments", "")
        if not isinstance(name, str):
            raise NormalizerError("function_call needs a string 'name'", param=f"{where}.name")
        if not isinstance(arguments, str):
            raise NormalizerError("'arguments' must be a JSON string", param=f"{where}.arguments")
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": name, "arguments": arguments}}  # fmt: skip
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _json_text(output, f"{where}.output")
        return {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text}
    if kind == "reasoning":
        return None
    if not isinstance(kind, str):
        raise NormalizerError("item 'type' must be a string", param=f"{where}.type")
    return {"role": f"item:{kind}", "content": _json_text(item, where)}


def _json_text(value: Any, where: str) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:  # e.g. an integer beyond 64 bits
        raise NormalizerError(
            "must be JSON (string keys, finite numbers, 64-bit integers)", param=where
        ) from None


def _tools(raw: Any) -> list[Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise NormalizerError("'tools' must be an array", param="tools")
    tools: list[Any] = []
    for i, tool in enumerate(raw):
        if isinstance(tool, Mapping) and tool.get("type") == "function" and isinstance(tool.get("name"), str):
            params = tool.get("parameters")
            if params is not None and not isinstance(params, Mapping):  # named as the client wrote it
                raise NormalizerError(
                    "'parameters' must be a JSON Schema object", param=f"tools[{i}].parameters"
                )
            tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        else:
            tools.append(tool)  # validated (and keyed) by the chat machinery as it is
    return tools or None


def responses_chat(body: Mapping[str, Any]) -> ConvertedChat:
    """The chat request a Responses body renders as; NormalizerError naming the field otherwise."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise NormalizerError("'instructions' must be a string", param="instructions")
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    chat: dict[str, Any] = {"messages": messages}
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise NormalizerError(
                "'previous_response_id' must be a non-empty string", param="previous_response_id"
            )
        # The stored turns come next on the worker: nothing after the instructions is keyed, and
        # no generation prompt closes what is keyed.
        chat["add_generation_prompt"] = False
        note = "previous_response_id: keyed up to the instructions (the stored conversation is the worker's)"
        return ConvertedChat(chat, tuple(sources), diagnostics=(note,))
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        sources.append("input")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            message = _item(item, f"input[{i}]")
            if message is not None:
                messages.append(message)
                sources.append(f"input[{i}]")
    else:
        raise NormalizerError("'input' must be a string or an array of items", param="input")
    return ConvertedChat(chat, tuple(sources))
