"""Native generate requests: SGLang's `/generate` and vLLM's `/inference/v1/generate`.

Their prompt is raw model input, as a completions `prompt` is: SGLang's `text` (a string or a
batch of strings) or `input_ids` (token ids or a batch of them), vLLM's `token_ids`. No chat
template applies, so the prompt is keyed exactly as the same completions prompt would be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prompt_normalizer.errors import NormalizerError

GENERATE_PROMPT_FIELDS = ("text", "input_ids", "token_ids")


def generate_as_completions(body: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The completions-shaped body that keys the same prompt, `{"prompt": ...}` from the first
    prompt field the body sets (plus `add_special_tokens` when it names one), and that field's
    name (errors and diagnostics name the client's field)."""
    for name in GENERATE_PROMPT_FIELDS:
        value = body.get(name)
        if value is not None:
            out: dict[str, Any] = {"prompt": value}
            if "add_special_tokens" in body:
                out["add_special_tokens"] = body["add_special_tokens"]
            return out, name
    raise NormalizerError("'text' or 'input_ids' is required", param="text", code="missing_prompt")
