"""Approximate mode: no tokenizer, canonical text cut into fixed character chunks.

One "token" is `chars_per_token` characters of a deterministic serialization of the canonical
request; a block is `block_size_tokens * chars_per_token` characters, hashed as UTF-32-LE so that
a character is always 4 bytes. The serialization is append-stable: each message's text depends
only on that message, so appending turns only appends text. Template fields come first, then the
immutable messages, the tools, the other messages, the volatile message and the generation marker.
"""

from __future__ import annotations

from typing import Any

import orjson

from prompt_normalizer.canonical import CanonicalChat
from prompt_normalizer.layout import Boundaries, Hashed

APPROX_UNIT = "approx-u32-v1"


def _message_text(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if len(msg) == 2 and isinstance(content, str):  # the common case: role and text only
        return f"<|{msg['role']}|>{content}<|end|>\n"
    parts = [f"<|{msg['role']}|>"]
    for name in sorted(k for k in msg if k not in ("role", "content")):
        parts.append(f"<|{name}|>{orjson.dumps(msg[name], option=orjson.OPT_SORT_KEYS).decode()}")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            parts.append(part["text"] if part.get("type") == "text" else f"<|{part.get('type')}|>")
    parts.append("<|end|>\n")
    return "".join(parts)


def approx_chat(chat: CanonicalChat, chars_per_token: int) -> tuple[Hashed, Boundaries]:
    """Canonical text of a chat request, and its zone boundaries in approximate tokens."""
    pieces: list[str] = []
    append = pieces.append
    offset = 0
    # Message start offsets are needed only to place media digests.
    starts: dict[int, int] | None = {} if chat.media else None
    messages = chat.messages
    if chat.template:
        append(f"<|template|>{orjson.dumps(chat.template, option=orjson.OPT_SORT_KEYS).decode()}\n")
        offset += len(pieces[-1])
    for i in range(chat.n_immutable):
        if starts is not None:
            starts[i] = offset
        append(_message_text(messages[i]))
        offset += len(pieces[-1])
    before_tools = offset
    if chat.tools:
        # Tool key order is whatever canonicalization left (sorted when canonical_json is on).
        append(f"<|tools|>{orjson.dumps(list(chat.tools)).decode()}\n")
        offset += len(pieces[-1])
    immutable_end = offset if chat.tools_immutable else before_tools
    stable_end = None
    for i in range(chat.n_immutable, len(messages)):
        if i == chat.volatile_index:
            stable_end = offset
        if starts is not None:
            starts[i] = offset
        append(_message_text(messages[i]))
        offset += len(pieces[-1])
    if stable_end is None:
        stable_end = offset
    if chat.add_generation_prompt and not chat.continue_final_message:
        append("<|assistant|>")
    text = "".join(pieces)
    c = chars_per_token
    media = {m.message_index: starts[m.message_index] // c for m in chat.media} if starts is not None else {}
    hashed = Hashed(text.encode("utf-32-le"), 4 * c, len(text) // c)
    return hashed, Boundaries(immutable_end // c, stable_end // c, media)


def approx_text(text: str, chars_per_token: int) -> Hashed:
    """A completions prompt string in approximate mode."""
    return Hashed(text.encode("utf-32-le"), 4 * chars_per_token, len(text) // chars_per_token)
