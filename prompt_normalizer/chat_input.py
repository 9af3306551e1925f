"""Validation of a chat request's input, and the copy canonicalization works on.

Every structure the normalizer walks is type-checked here first, so a wrong type is a
`NormalizerError` naming the field (formatted only on the error path), never a `TypeError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import orjson

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.lax import lax_bool


@dataclass(slots=True)
class Copied:
    """The messages (or tools) to canonicalize, the size of their serialization, and whether every
    string in them is ASCII (then NFC cannot change them: the serialization is ASCII exactly when
    all its strings are). `private` says whether `value` is a deep copy (else a new list of the
    caller's own message objects, which canonicalization must not edit). For messages also:
    whether any has content parts, and any has tool calls or is a tool result (the only messages
    canonical JSON can touch)."""

    value: Any
    n_bytes: int
    ascii: bool
    private: bool = True
    has_parts: bool = False
    structured: bool = False


def _copy(value: Any, param: str) -> Copied:
    try:
        raw = orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        raise NormalizerError("must be JSON (string keys, finite numbers)", param=param) from None
    return Copied(orjson.loads(raw), len(raw), raw.isascii())


def _flat(messages: list[Any]) -> bool:
    """Whether every message is a plain dict of plain strings (or nulls) with a non-empty role, no
    tool calls, and is not a tool result: then it is valid as it is, a JSON round trip would give
    an equal message of the same types, and only NFC, the whitespace switch and volatile rules
    could change it."""
    for msg in messages:
        if type(msg) is not dict or "tool_calls" in msg:
            return False
        for name, value in msg.items():
            if type(name) is not str or (type(value) is not str and value is not None):
                return False
        role = msg.get("role")  # a string or None by now
        if not role or role == "tool":
            return False
    return True


# The most content parts other than text one request may carry, across all its messages: images,
# audio, files and any other type. Each is keyed on its own (a keyed digest folded into the block
# where its message starts), which makes such a part several times the work of a text part; a
# 256 KiB body of 20,000 one-field parts held the event loop for about 0.1 s. OpenAI takes at
# most 500 images a request (its "Images and vision" guide): four times that leaves every
# realistic request alone (docs/reliability.md).
MAX_MEDIA_PARTS = 2048

# The most content parts sent as plain strings (`"content": ["hi"]`, which vLLM reads as text
# parts) one request may carry, across all its messages. Each becomes a text part object here,
# at the cost of one, but the gateway's count of a body's objects (`gateway.keying.keyed_apart`,
# which sends a body of many to the keying process) sees only braces: 62,000 one-letter string
# parts, 248 KB, held the event loop for 35 ms. Past this many the request is refused before
# more are converted; no client sends thousands of string parts where one string would do.
MAX_STRING_PARTS = 2048


def validate_messages(raw: Any, edits_flat_messages: bool, unicode_nfc: bool) -> Copied:
    """Checks `messages` and gives what canonicalization works on: a private copy, or (when
    nothing will edit them: see `_flat`) a new list of the caller's own flat messages."""
    if not isinstance(raw, list) or not raw:
        raise NormalizerError("'messages' must be a non-empty array", param="messages")
    try:
        data = orjson.dumps(raw)
    except (TypeError, orjson.JSONEncodeError):
        raise NormalizerError("must be JSON (string keys, finite numbers)", param="messages") from None
    ascii_only = data.isascii()
    if not edits_flat_messages and (ascii_only or not unicode_nfc) and _flat(raw):
        # The common request: nothing will edit these messages, so skip parsing a private copy
        # (the round trip's `loads` is most of its cost); a new list keeps the caller's intact.
        return Copied(list(raw), len(data), ascii_only, False)
    copied = Copied(orjson.loads(data), len(data), ascii_only)
    messages: list[dict[str, Any]] = copied.value
    media = 0  # content parts other than text (`MAX_MEDIA_PARTS`)
    strings = 0  # content parts sent as strings (`MAX_STRING_PARTS`)
    # Exact type checks: the copy is what `orjson.loads` built, so no value is of a subclass.
    for i, msg in enumerate(messages):
        # Paths are formatted only on the error paths: this loop runs for every request.
        if type(msg) is not dict:
            raise NormalizerError("each message must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if type(role) is not str or not role:
            raise NormalizerError("message 'role' must be a non-empty string", param=f"messages[{i}].role")
        if role == "tool":
            copied.structured = True
        if "tool_calls" in msg:
            _validate_tool_calls(msg, i)
            copied.structured = True
        content = msg.get("content")
        if content is None or type(content) is str:
            continue
        if type(content) is not list:
            raise NormalizerError(
                "content must be a string or an array of parts", param=f"messages[{i}].content"
            )
        copied.has_parts = True
        for j, part in enumerate(content):
            if type(part) is str:
                # vLLM reads a string part as a text part and renders the two alike, so it becomes
                # one here: it keys as the same text sent as a text part, and whoever reads the
                # parts next (switches, rules, renderers, the canonical body) sees one shape.
                content[j] = {"type": "text", "text": part}
                strings += 1
                if strings > MAX_STRING_PARTS:
                    raise NormalizerError(
                        f"the request has more than {MAX_STRING_PARTS} content parts sent as strings: "
                        "this gateway takes at most that many a request (send text parts, or join the text)",
                        param="messages",
                        code="array_above_max_length",
                    )
                continue
            ptype = part.get("type") if type(part) is dict else None
            if ptype == "text":
                if type(part.get("text")) is not str:
                    _bad_part(content, i, part, "text part needs a string 'text'", ".text")
            elif type(ptype) is str or (ptype is None and type(part) is dict and untyped_part(part)):
                media += 1
            else:
                _bad_part(content, i, part, "each content part needs a 'type'", "")
    if media > MAX_MEDIA_PARTS:
        raise NormalizerError(
            f"the request has {media} content parts that are not text (images, audio, files, ...): "
            f"this gateway takes at most {MAX_MEDIA_PARTS} a request",
            param="messages",
            code="array_above_max_length",
        )
    return copied


# The fields that give a content part without a `type` its type, the first one present winning, in
# vLLM's order (`parse_chat_message_content_mm_part`): `{"image_url": "https://..."}` is an image,
# as is `{"image_url": {"url": ...}, "uuid": ...}`. A part without a `type` and without any of
# them is refused there and here.
UNTYPED_PART_FIELDS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)


def untyped_part(part: dict[str, Any]) -> str | None:
    """The type vLLM gives a content part sent without one (`UNTYPED_PART_FIELDS`), if any."""
    for name in UNTYPED_PART_FIELDS:
        if name in part:
            return name
    return None


def part_type(part: dict[str, Any]) -> str:
    """The type of a content part `validate_messages` accepted: its own, else the one its fields
    give it (`untyped_part`). Text parts always have theirs by then (a string part became one)."""
    ptype = part.get("type")
    if ptype is None:
        return untyped_part(part) or ""
    return str(ptype)


def _bad_part(content: list[Any], i: int, part: Any, message: str, suffix: str) -> NoReturn:
    """Raise `message` for `part` of message `i` (its path found only now, on the error path)."""
    j = next(j for j, p in enumerate(content) if p is part)
    raise NormalizerError(message, param=f"messages[{i}].content[{j}]{suffix}")


def _validate_tool_calls(msg: dict[str, Any], i: int) -> None:
    """The tool calls of message `i` (paths are formatted only on the error paths)."""
    calls = msg.get("tool_calls")
    if calls is None:
        return
    if type(calls) is not list:
        raise NormalizerError(
            "'tool_calls' must be an array of tool calls", param=f"messages[{i}].tool_calls"
        )
    for j, call in enumerate(calls):
        if type(call) is not dict:
            raise NormalizerError("each tool call must be an object", param=f"messages[{i}].tool_calls[{j}]")
        fn = call.get("function")
        if call.get("type", "function") == "function" or fn is not None:
            if type(fn) is not dict or type(fn.get("name")) is not str:
                path = f"messages[{i}].tool_calls[{j}].function"
                raise NormalizerError("function tool call needs 'function.name'", param=path)
            args = fn.get("arguments")
            if args is not None and type(args) is not str and type(args) is not dict:
                path = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise NormalizerError("'arguments' must be a JSON string or an object", param=path)


def validate_template_fields(body: Mapping[str, Any]) -> None:
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise NormalizerError("'chat_template' must be a string", param="chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise NormalizerError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list):
            raise NormalizerError("'documents' must be an array of objects", param="documents")
        for i, doc in enumerate(documents):
            if not isinstance(doc, dict):
                raise NormalizerError("each document must be an object", param=f"documents[{i}]")


def request_flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean request field (absent or null: the default), read as vLLM's lax pydantic model
    reads it (`"true"`, 1, `"yes"`...: `lax.lax_bool`); anything else is a NormalizerError."""
    value = body.get(name)
    if value is None:
        return default
    if value is True or value is False:
        return value
    flag = lax_bool(value)
    if flag is None:
        raise NormalizerError(f"'{name}' must be a boolean", param=name)
    return flag


def validate_tools(raw: Any) -> Copied | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise NormalizerError("'tools' must be an array", param="tools")
    if not raw:
        return None
    copied = _copy(raw, "tools")
    tools: list[dict[str, Any]] = copied.value
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise NormalizerError("each tool must be an object", param=f"tools[{i}]")
        fn = tool.get("function")
        if tool.get("type", "function") == "function" and not (
            isinstance(fn, dict) and isinstance(fn.get("name"), str)
        ):
            raise NormalizerError("function tool needs 'function.name'", param=f"tools[{i}].function")
        # `null` is no schema, as absent (vLLM's `parameters: dict | None`; the OpenAI SDK's typed
        # tools always send the key).
        if (
            isinstance(fn, dict)
            and fn.get("parameters") is not None
            and not isinstance(fn["parameters"], dict)
        ):
            raise NormalizerError(
                "'parameters' must be a JSON Schema object", param=f"tools[{i}].function.parameters"
            )
    return copied
