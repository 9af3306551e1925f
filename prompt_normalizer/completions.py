"""Completions prompts: a string, a list of strings, token ids, or a list of token-id lists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import TokenArray, as_tokens


class CompletionsPrompt:
    """A completions `prompt`: text or token ids (a batch is keyed by its first prompt)."""

    def __init__(self, body: Mapping[str, Any], max_chars: int) -> None:
        prompt = body.get("prompt")
        self.diagnostics: list[str] = []
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > 1:
                self.diagnostics.append(f"prompt: batch of {len(prompt)} prompts, keyed by prompt[0]")
            prompt = prompt[0]
        self.text: str | None = None
        self.tokens: TokenArray | None = None
        if isinstance(prompt, (str, list)) and len(prompt) > max_chars:
            raise NormalizerError(
                "prompt is larger than this pool accepts", param="prompt", code="input_too_large"
            )
        if isinstance(prompt, str):
            self.text = prompt
        elif isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            self.tokens = as_tokens(prompt, param="prompt")  # validates every id, vectorized
        else:
            raise NormalizerError("'prompt' must be a string, a list of strings or token ids", param="prompt")
