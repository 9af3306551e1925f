"""Anthropic Messages as vLLM serves it (`/v1/messages`): requests to chat prompts, bodies, usage.

The request becomes chat messages as vLLM converts it (system text blocks joined into one system
message; `tool_use` blocks become assistant tool calls; a user's `tool_result` becomes a tool
message; images become image parts; thinking blocks are dropped) and runs through the engine
model like chat. `cache_control` marks a breakpoint: the prompt up to the end of the last marked
block (in full KV blocks) is what the request asks to cache. Usage then reports, from the
engine's prefix cache, `cache_read_input_tokens` (the hit), `cache_creation_input_tokens` (the
marked prefix beyond the hit, now cached) and `input_tokens` (the rest), so the three add up to
the prompt.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from loadtest.emulator.chat_template import IMAGE_TOKENS, render_chat_offsets
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError, RequestValidationError
from loadtest.emulator.live import LiveGroup
from loadtest.emulator.protocol import (
    GenerationRequest,
    check_sampling,
    common_fields,
    int_field,
    one_answer_request,
    stop_strings,
    tool_call_for,
)
from loadtest.emulator.stops import StopRule
from loadtest.engine.tokenizer import Tokenizer

# Anthropic's error types by HTTP status (the envelope is {"type": "error", "error": {...}}).
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
_END = "<|end|>\n"


def error_body(exc: ApiError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message},
    }


@dataclass(frozen=True, slots=True)
class MessagesCall:
    """A validated Messages request; `cacheable_tokens` is the marked prefix in full blocks."""

    gen: GenerationRequest
    message_id: str
    cacheable_tokens: int


@dataclass(frozen=True, slots=True)
class _Mark:
    """A breakpoint: chat message `index`, at `offset` characters into its content (None: its end)."""

    index: int
    offset: int | None


# Claude Code's per-request attribution header: vLLM leaves a system text starting with it out.
BILLING_HEADER = "x-anthropic-billing-header"
# Roles Claude Code sends beyond Anthropic's, which vLLM reads as a user's.
_AS_USER = {"ctx": "user", "msg": "user"}


class _Converter:
    """Builds chat messages from Anthropic blocks, remembering where `cache_control` falls."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.marks: list[_Mark] = []

    def system(self, system: Any) -> None:
        if system is None:
            return
        if isinstance(system, str):
            if system and not system.startswith(BILLING_HEADER):
                self.messages.append({"role": "system", "content": system})
            return
        if not isinstance(system, list):
            raise ApiError.bad_request("system must be a string or a list of text blocks", "system")
        text = ""
        for j, block in enumerate(system):
            if (
                not isinstance(block, Mapping)
                or block.get("type") != "text"
                or not isinstance(block.get("text"), str)
            ):
                raise ApiError.bad_request("system blocks must be text blocks", f"system[{j}]")
            if block["text"].startswith(BILLING_HEADER):  # as vLLM: not part of the prompt
                continue
            text += block["text"]
            if block.get("cache_control") is not None:
                self.marks.append(_Mark(len(self.messages), len(text)))
        if text:
            self.messages.append({"role": "system", "content": text})

    def message(self, msg: Any, where: str) -> None:
        role = msg.get("role") if isinstance(msg, Mapping) else None
        role = _AS_USER.get(role, role) if isinstance(role, str) else role
        if role == "system":  # Claude Code's inline system message, kept where it stands
            content = msg.get("content")
            if isinstance(content, list):
                content = "".join(
                    b["text"]
                    for b in content
                    if isinstance(b, Mapping) and b.get("type") == "text" and isinstance(b.get("text"), str)
                    and not b["text"].startswith(BILLING_HEADER)
                )  # fmt: skip
            if isinstance(content, str) and content and not content.startswith(BILLING_HEADER):
                self.messages.append({"role": "system", "content": content})
            return
        if role not in ("user", "assistant"):
            raise ApiError.bad_request('role must be "user", "assistant" or "system"', f"{where}.role")
        content = msg.get("content")
        if isinstance(content, str):
            self.messages.append({"role": role, "content": content})
            return
        if not isinstance(content, list):
            raise ApiError.bad_request("content must be a string or a list of blocks", f"{where}.content")
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        length = 0  # characters of the rendered content so far
        own_marks: list[int | None] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, Mapping) else None
            here = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": block["text"]})
                length += len(block["text"])
            elif kind == "image" and isinstance(block.get("source"), Mapping):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"], here)}})
                length += IMAGE_TOKENS
            elif kind == "tool_use" and isinstance(block.get("name"), str):
                args = orjson.dumps(block.get("input") or {}).decode()
                fn = {"name": block["name"], "arguments": args}
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": fn})
            elif kind == "tool_result" and role == "user":
                self.messages.append(
                    {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                     "content": _tool_result_text(block.get("content"), here)}
                )  # fmt: skip
                if block.get("cache_control") is not None:
                    self.marks.append(_Mark(len(self.messages) - 1, None))
                continue
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ApiError.bad_request("unsupported content block", here)
            if block.get("cache_control") is not None:
                own_marks.append(length if kind in ("text", "image") else None)
        if not parts and not calls:
            return
        out: dict[str, Any] = {"role": role, "content": parts or None}
        if calls:
            out["tool_calls"] = calls
        self.marks.extend(_Mark(len(self.messages), m) for m in own_marks)
        self.messages.append(out)


def _image_url(source: Mapping[str, Any], where: str) -> str:
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    if isinstance(source.get("data"), str):
        return f"data:{source.get('media_type', 'image/jpeg')};base64,{source['data']}"
    raise ApiError.bad_request("image source needs a url or base64 data", f"{where}.source")


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(
            str(b.get("text", "")) for b in content if isinstance(b, Mapping) and b.get("type") == "text"
        )
    raise ApiError.bad_request("tool_result content must be a string or blocks", f"{where}.content")


def _tools(tools: Any) -> tuple[list[dict[str, Any]] | None, bool]:
    """Anthropic tools in the chat shape, and whether one carries `cache_control`."""
    if tools is None:
        return None, False
    if not isinstance(tools, list):
        raise ApiError.bad_request("tools must be a list", "tools")
    out: list[dict[str, Any]] = []
    marked = False
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise ApiError.bad_request("each tool needs a name", f"tools[{i}].name")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
        marked = marked or tool.get("cache_control") is not None
    return out, marked


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise ApiError.bad_request('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice")


def _check_stop_sequences(value: Any) -> None:
    """vLLM's `stop_sequences: list[str] | None`: pydantic refuses anything else (a single string
    too) before vLLM looks at the body."""
    if value is None:
        return
    if not isinstance(value, list):
        raise RequestValidationError(
            {"type": "list_type", "loc": ("body", "stop_sequences"), "msg": "Input should be a valid list",
             "input": value}
        )  # fmt: skip
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise RequestValidationError(
                {"type": "string_type", "loc": ("body", "stop_sequences", i),
                 "msg": "Input should be a valid string", "input": item}
            )  # fmt: skip


def parse_messages(
    body: Mapping[str, Any], cfg: EmulatorConfig, tokenizer: Tokenizer, block_size: int
) -> MessagesCall:
    _check_stop_sequences(body.get("stop_sequences"))
    if "model" not in body:
        raise ApiError.bad_request("model: Field required", "model")
    common = common_fields(body, cfg)
    check_sampling(body, ("temperature", "top_p"), ("top_k",))  # Anthropic's request model's
    max_tokens = int_field(body, "max_tokens", 1)
    if max_tokens is None:
        raise ApiError.bad_request("max_tokens: Field required", "max_tokens")
    conv = _Converter()
    conv.system(body.get("system"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError.bad_request("messages must be a non-empty list", "messages")
    for i, msg in enumerate(messages):
        conv.message(msg, f"messages[{i}]")
    tools, tools_marked = _tools(body.get("tools"))
    rendered = render_chat_offsets(conv.messages, tools)
    text = rendered.text
    ends = [text.find(_END, text.find("<|tools|>\n")) + len(_END)] if tools_marked else []
    for mark in conv.marks:
        start = rendered.content_starts[mark.index]
        ends.append(start + mark.offset if mark.offset is not None else text.find(_END, start) + len(_END))
    prompt = tokenizer.encode(text)
    marked = len(tokenizer.encode(text[: max(ends)])) if ends else 0
    tool = tool_call_for(tools, _tool_choice(body.get("tool_choice")), conv.messages)
    stops = stop_strings(body, "stop_sequences")  # vLLM passes them on as chat's `stop`
    gen = one_answer_request("messages", common, prompt, max_tokens, tool, StopRule(stops) if stops else None)
    # A hit covers at most prompt - 1 tokens, and only full blocks are cached.
    cacheable = min(marked, len(prompt) - 1) // block_size * block_size
    return MessagesCall(gen, f"msg_{uuid.uuid4().hex}", cacheable)


def count_tokens_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A count_tokens body as `parse_messages` takes it: vLLM's count_tokens request model has no
    `max_tokens` or `stop_sequences`, so whatever they hold is ignored there."""
    return {**{k: v for k, v in body.items() if k not in ("max_tokens", "stop_sequences")}, "max_tokens": 1}


def usage(call: MessagesCall, group: LiveGroup) -> dict[str, int]:
    live = group.lives[0]
    read = live.cached_tokens
    creation = max(0, call.cacheable_tokens - read)
    return {
        "input_tokens": live.num_prompt_tokens - read - creation,
        "output_tokens": min(live.produced, live.num_output_tokens),
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
    }


def stop_reason(group: LiveGroup) -> str:
    """vLLM's mapping of the chat finish reason; a stop string is `stop_sequence` (with the string
    in `stop_sequence`) since vLLM PR #45807."""
    return {"tool_calls": "tool_use", "stop": "stop_sequence"}.get(group.lives[0].finish_reason, "max_tokens")


def stop_sequence(group: LiveGroup) -> str | None:
    return group.lives[0].answer.stop_reason


def tool_use_id(group: LiveGroup) -> str:
    return f"toolu_{group.lives[0].request_id[:24]}"


def content_block(group: LiveGroup, text: str, final: bool) -> dict[str, Any]:
    """The answer's one content block (empty while streaming starts)."""
    call = group.gen.tool_call
    if call is None:
        return {"type": "text", "text": text}
    return {"type": "tool_use", "id": tool_use_id(group), "name": call.name,
            "input": orjson.loads(text) if final else {}}  # fmt: skip


def message_body(call: MessagesCall, group: LiveGroup, done: bool) -> dict[str, Any]:
    """The message; an empty text answer (a stop string at its start) has no block, as in vLLM."""
    text = group.lives[0].answer.text
    has_block = done and (bool(text) or group.gen.tool_call is not None)
    return {
        "id": call.message_id,
        "type": "message",
        "role": "assistant",
        "model": group.gen.model,
        "content": [content_block(group, text, True)] if has_block else [],
        "stop_reason": stop_reason(group) if done else None,
        "stop_sequence": stop_sequence(group) if done else None,
        "usage": usage(call, group),
    }
