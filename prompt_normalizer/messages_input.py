"""Anthropic Messages requests as the chat request vLLM renders for them.

    system (string, or text blocks joined)  -> one system message (without Claude Code's billing
                                               header, which vLLM leaves out too)
    a `system` message inside `messages`    -> a system message where it stands (ctx, msg: user)
    text blocks                             -> text parts (one text part: a plain string)
    image blocks                            -> image parts (keyed by their digest)
    thinking blocks                         -> the message's `reasoning`
    tool_use blocks                         -> assistant tool calls (arguments as JSON text)
    a user's tool_result blocks             -> tool messages (an assistant's: "Tool result: ...")
    tools (name, description, input_schema) -> chat function tools

`cache_control` is the client saying where its stable prefix ends, in Anthropic's prefix order
tools → system → messages. A breakpoint in the system blocks or the tools is an explicit end of
the immutable zone, replacing the pool's zone rules: on the last system block, the tools and the
system message are immutable; on an earlier system block, only the tools (zones end at message
boundaries, and the system blocks are one message, as vLLM joins them); on the last tool alone,
the tools. Breakpoints in messages mark the conversation, which is append-only anyway. The marks
themselves never enter the keys (the worker ignores them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prompt_normalizer.converted import ConvertedChat
from prompt_normalizer.errors import NormalizerError

# Claude Code's per-request attribution header, a system text vLLM leaves out of the prompt it
# renders: keyed, it would give every request of a conversation keys of its own.
BILLING_HEADER = "x-anthropic-billing-header"
# Roles Claude Code sends beyond Anthropic's, which vLLM reads as a user's.
_AS_USER = {"ctx": "user", "msg": "user"}


def _system(raw: Any) -> tuple[str | None, int | None, int]:
    """The system text, the index of its last marked block (None: none) and its block count."""
    if raw is None or isinstance(raw, str):
        return (None if raw is None or raw.startswith(BILLING_HEADER) else raw or None), None, 0
    if not isinstance(raw, list):
        raise NormalizerError("'system' must be a string or an array of text blocks", param="system")
    text, last_mark, kept = "", None, 0
    for j, block in enumerate(raw):
        if (
            not isinstance(block, Mapping)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise NormalizerError("system blocks must be text blocks", param=f"system[{j}]")
        if not block["text"].startswith(BILLING_HEADER):
            text += block["text"]
            kept += 1
        if block.get("cache_control") is not None:
            last_mark = j
    return (text if kept else None), last_mark, len(raw)


def _inline_system(content: Any, where: str) -> str:
    """The text of a `system` message inside `messages` (Claude Code sends them), as vLLM reads
    it: its text blocks joined, without the billing header; other blocks are left out."""
    if isinstance(content, str):
        return "" if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        raise NormalizerError("content must be a string or an array of blocks", param=f"{where}.content")
    return "".join(
        b["text"]
        for b in content
        if isinstance(b, Mapping)
        and b.get("type") == "text"
        and isinstance(b.get("text"), str)
        and not b["text"].startswith(BILLING_HEADER)
    )


def _tool_result_text(content: Any) -> str:
    # As vLLM writes it: the content's string form (a block list in Python's notation).
    return str(content) if content else ""


def _image(block: Mapping[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, Mapping):
        url = source.get("data") if isinstance(source.get("data"), str) else source.get("url")
        if isinstance(url, str):
            return {"type": "image_url", "image_url": {"url": url}}
    return dict(block)


def _message(msg: Any, where: str, out: list[dict[str, Any]], sources: list[str]) -> None:
    """Append the chat messages of one Anthropic message (tool results come first, as their own)."""
    role = msg.get("role") if isinstance(msg, Mapping) else None
    role = _AS_USER.get(role, role) if isinstance(role, str) else role
    if role == "system":
        # Keyed where it stands: vLLM keeps it there as a system turn or folds it into the message
        # beside it, either way only the end of the prompt, so earlier turns keep their keys.
        if text := _inline_system(msg.get("content"), where):
            out.append({"role": "system", "content": text})
            sources.append(where)
        return
    if role not in ("user", "assistant"):
        raise NormalizerError('message role must be "user", "assistant" or "system"', param=f"{where}.role")
    content = msg.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        sources.append(where)
        return
    if not isinstance(content, list):
        raise NormalizerError("content must be a string or an array of blocks", param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        here = f"{where}.content[{j}]"
        if not isinstance(kind, str):
            raise NormalizerError("each content block needs a 'type'", param=here)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise NormalizerError("text block needs a string 'text'", param=f"{here}.text")
            if block["text"]:
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(block))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise NormalizerError("tool_use block needs a string 'name'", param=f"{here}.name")
            fn = {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}
            calls.append({"id": str(block.get("id") or ""), "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id") or block.get("id") or ""
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(call_id),
                    "content": _tool_result_text(block.get("content")),
                }
            )
            sources.append(here)
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {_tool_result_text(block.get('content'))}"})
        elif kind != "redacted_thinking":
            parts.append(dict(block))  # a document, say: keyed by its digest like media
    if not parts and not calls and not reasoning:
        return
    message: dict[str, Any] = {"role": role}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        text_only = len(parts) == 1 and parts[0].get("type") == "text"
        message["content"] = parts[0]["text"] if text_only else parts
    out.append(message)
    sources.append(where)


def _tools(raw: Any) -> tuple[list[dict[str, Any]] | None, bool, bool]:
    """Chat tools, whether any tool is marked, and whether the last one is."""
    if raw is None:
        return None, False, False
    if not isinstance(raw, list):
        raise NormalizerError("'tools' must be an array", param="tools")
    tools: list[dict[str, Any]] = []
    marks = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise NormalizerError("each tool needs a string 'name'", param=f"tools[{i}].name")
        if not isinstance(tool.get("input_schema"), Mapping):  # required, as vLLM reads it
            raise NormalizerError(
                "each tool needs an object 'input_schema'", param=f"tools[{i}].input_schema"
            )
        fn = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
        }
        tools.append({"type": "function", "function": fn})
        marks.append(tool.get("cache_control") is not None)
    return (tools or None), any(marks), bool(marks) and marks[-1]


def messages_chat(body: Mapping[str, Any]) -> ConvertedChat:
    """The chat request a Messages body renders as; NormalizerError naming the field otherwise."""
    system, last_mark, n_blocks = _system(body.get("system"))
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
        sources.append("system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise NormalizerError("'messages' must be a non-empty array", param="messages")
    for i, msg in enumerate(raw):
        _message(msg, f"messages[{i}]", messages, sources)
    tools, any_tool_marked, last_tool_marked = _tools(body.get("tools"))
    chat: dict[str, Any] = {"messages": messages}
    if tools is not None:
        chat["tools"] = tools
    if last_mark is not None:
        if last_mark == n_blocks - 1:
            return ConvertedChat(chat, tuple(sources), 1, True)
        note = f"zones: cache_control on system[{last_mark}], inside the system message: tools only immutable"
        return ConvertedChat(chat, tuple(sources), 0, True, (note,))
    if any_tool_marked:
        notes = () if last_tool_marked else ("zones: cache_control before the last tool: no immutable zone",)
        return ConvertedChat(chat, tuple(sources), 0, last_tool_marked, notes)
    return ConvertedChat(chat, tuple(sources))
