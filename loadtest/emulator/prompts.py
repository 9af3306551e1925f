"""Prompts given as text or token ids (`prompt`, `input`, a read's questions): one prompt or a
batch of them, as the token ids the worker runs, bad values refused naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from loadtest.emulator.errors import ApiError
from loadtest.engine.tokenizer import Tokenizer, TokenizerError


def _token_ids(prompt: list[Any], tokenizer: Tokenizer, where: str) -> np.ndarray:
    ids = np.asarray(prompt, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
        raise ApiError.bad_request(f"token ids must be in 0..{tokenizer.vocab_size - 1}", where)
    return ids


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def prompt_batch(value: Any, tokenizer: Tokenizer, param: str) -> tuple[np.ndarray, ...]:
    """Token ids of a prompt-like field (`prompt`, `input`): a string, token ids, or a batch
    (list) of either."""
    if _is_ids(value):
        return (_token_ids(value, tokenizer, param),)
    batch = value if isinstance(value, list) and value else [value]
    out: list[np.ndarray] = []
    for item in batch:
        if isinstance(item, str) and item:
            try:
                out.append(tokenizer.encode(item))
            except TokenizerError as exc:
                raise ApiError.bad_request(str(exc), param) from exc
        elif _is_ids(item):
            out.append(_token_ids(item, tokenizer, param))
        else:
            raise ApiError.bad_request(
                f"{param} must be a non-empty string, a list of token ids, or a list of either", param
            )
    return tuple(out)


def completion_prompts(body: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[np.ndarray, ...]:
    """Token ids of a completions `prompt`: a string, token ids, or a batch (list) of either."""
    return prompt_batch(body.get("prompt"), tokenizer, "prompt")


def completion_prompt_ids(body: Mapping[str, Any], tokenizer: Tokenizer) -> np.ndarray:
    """The one prompt of a body that takes a single prompt (tokenize)."""
    prompts = completion_prompts(body, tokenizer)
    if len(prompts) != 1:
        raise ApiError.bad_request("exactly one prompt is expected here", "prompt")
    return prompts[0]
