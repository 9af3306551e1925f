"""Chat bodies for the normalizer's tests: a system prompt long enough to fill blocks, turns."""

from __future__ import annotations

from typing import Any

from prompt_normalizer.types import KeyIdentity

IDENT = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4)
SYSTEM = "You are terse. " * 20


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": list(messages), **extra}


def sys_msg(text: str = SYSTEM) -> dict[str, Any]:
    return {"role": "system", "content": text}


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **extra}


def assistant(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **extra}
