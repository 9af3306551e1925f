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
from prompt_normalizer.chat_input import part_type
from prompt_normalizer.layout import Boundaries, Hashed

APPROX_UNIT = "approx-u32-v1"


def _message_text(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if len(msg) == 2 and isinstance(content, str):  # the common case: role and text only
        return f"<|{msg['role']}|>{content}<|end|>\n"
    head = f"<|{msg['role']}|>"
    if len(msg) > (2 if "content" in msg else 1):  # fields besides role and content, sorted
        head += "".join(
            f"<|{name}|>{orjson.dumps(msg[name], option=orjson.OPT_SORT_KEYS).decode()}"
            for name in sorted(k for k in msg if k != "role" and k != "content")
        )
    if isinstance(content, str):
        return f"{head}{content}<|end|>\n"
    if isinstance(content, list):
        # One join of the parts (validated: each is an object, a text part with its type).
        text = "".join(
            [part["text"] if part.get("type") == "text" else f"<|{part_type(part)}|>" for part in content]
        )
        return f"{head}{text}<|end|>\n"
    return f"{head}<|end|>\n"


def approx_chat(chat: CanonicalChat, chars_per_token: int) -> tuple[Hashed, Boundaries]:
    """Canonical text of a chat request, and its zone boundaries in approximate tokens."""
    messages = chat.messages
    n_imm = chat.n_immutable
    # The common message (a role and its text) is written inline: a call per message would cost
    # more than its f-string.
    texts = [
        f"<|{msg['role']}|>{msg['content']}<|end|>\n"
        if len(msg) == 2 and type(msg.get("content")) is str
        else _message_text(msg)
        for msg in messages
    ]
    template = ""
    if chat.template:
        template = f"<|template|>{orjson.dumps(chat.template, option=orjson.OPT_SORT_KEYS).decode()}\n"
    # Tool key order is whatever canonicalization left (sorted when canonical_json is on).
    tools = f"<|tools|>{orjson.dumps(list(chat.tools)).decode()}\n" if chat.tools else ""
    generation = "<|assistant|>" if chat.add_generation_prompt and not chat.continue_final_message else ""
    # Offsets from the lengths of the parts, not from a running sum per message.
    head = template + "".join(texts[:n_imm])
    text = "".join((head, tools, *texts[n_imm:], generation))
    before_tools = len(head)
    immutable_end = before_tools + len(tools) if chat.tools_immutable else before_tools
    stable_end = len(text) - len(generation)
    if chat.volatile_index is not None:  # always the last message
        stable_end -= len(texts[chat.volatile_index])
    c = chars_per_token
    media: dict[int, int] = {}
    if chat.media:
        starts = _message_starts(texts, n_imm, len(template), len(tools))
        media = {m.message_index: starts[m.message_index] // c for m in chat.media}
    hashed = Hashed(None, 4 * c, len(text) // c, text)
    return hashed, Boundaries(immutable_end // c, stable_end // c, media)


def _message_starts(texts: list[str], n_imm: int, template_chars: int, tools_chars: int) -> list[int]:
    """Character offset of each message in the canonical text (the tools sit before message n_imm)."""
    starts = []
    offset = template_chars
    for i, piece in enumerate(texts):
        if i == n_imm:
            offset += tools_chars
        starts.append(offset)
        offset += len(piece)
    return starts


def approx_text(text: str, chars_per_token: int) -> Hashed:
    """A completions prompt string in approximate mode."""
    return Hashed(None, 4 * chars_per_token, len(text) // chars_per_token, text)
