"""Batched prompts: one completions or native generate request may carry several prompts (a list
of strings, or of token-id lists), each decoded with every choice it asks for. The normalizer
keys the first (`prompt_normalizer.completions`), so what the batch adds is counted here: the
sequences it decodes against `limits.max_choices`, and its prompts' size in the tokens the
tenant's tpm quota and the worker's load count.

A load-aware route may fan out too (`routes.Fanout`): vLLM's batch of chat completions decodes
each conversation of its `messages`, each with the chat budget. Its conversations count as the
sequences of a completions batch do."""

from __future__ import annotations

from typing import Any

from gateway.errors import ApiError
from gateway.routes import Fanout
from prompt_normalizer.generate_input import GENERATE_PROMPT_FIELDS


def batch_sizes(body: dict[str, Any], prompt: str | None) -> list[int] | None:
    """Each prompt's size (characters, or token ids) when the request batches two or more; None
    for one prompt (a string, or one list of token ids)."""
    entries = _batch(body, prompt)
    if entries is None:
        return None
    kind = str if isinstance(entries[0], str) else list
    return [len(e) if isinstance(e, kind) else 0 for e in entries]


def _batch(body: dict[str, Any], prompt: str | None) -> list[Any] | None:
    if prompt == "completions":
        entries = body.get("prompt")
    elif prompt == "generate":
        entries = next(
            (body[f] for f in GENERATE_PROMPT_FIELDS if isinstance(body.get(f), list) and body[f]), None
        )
    else:
        return None
    if not isinstance(entries, list) or len(entries) < 2 or not isinstance(entries[0], str | list):
        return None  # one prompt: a string, or the token ids of one
    return entries


def check_sequences(body: dict[str, Any], prompt: str | None, choices: int, max_choices: int) -> None:
    """A batch of B prompts with `choices` each decodes B × `choices` sequences: at most
    `max_choices`, as one prompt's `n` is (400 otherwise, naming the prompt field)."""
    sizes = batch_sizes(body, prompt)
    if sizes is None or len(sizes) * choices <= max_choices:
        return
    field = "prompt" if prompt == "completions" else next(f for f in GENERATE_PROMPT_FIELDS if f in body)
    message = (
        f"'{field}' is a batch of {len(sizes)} prompts with {choices} choices each: this gateway "
        f"serves at most {max_choices} sequences per request"
    )
    raise ApiError(400, message, "invalid_request_error", "integer_above_max_value", field)


def batch_tokens(body: dict[str, Any], prompt: str | None, first_tokens: int, chars_per_token: int) -> int:
    """The batch's prompt tokens: the first prompt's (`first_tokens`, the normalizer's count), and
    each other one estimated on its own: its token ids, or its characters at `chars_per_token`
    (the pool's approximate rate; the worker's `usage` corrects the tenant's quota when it ends).
    `first_tokens` for one prompt."""
    entries = _batch(body, prompt)
    if entries is None:
        return first_tokens
    rest = 0
    for entry in entries[1:]:
        if isinstance(entry, str):
            rest += -(-len(entry) // chars_per_token)
        elif isinstance(entry, list):
            rest += len(entry)
    return first_tokens + rest


# The field of a fanned-out body that lists the prompts its worker runs one by one.
_FANOUT_FIELDS: dict[Fanout, str] = {"conversations": "messages"}


def fanned_out(body: dict[str, Any], fanout: Fanout) -> int | None:
    """How many prompts a fanned-out body (`routes.Fanout`) runs: the conversations of a batch of
    chat completions (a list of message lists; a list of messages is one conversation, as one
    prompt of a completions batch is); None when the field is not a non-empty list (the worker's
    400)."""
    entries = body.get(_FANOUT_FIELDS[fanout])
    if not isinstance(entries, list) or not entries:
        return None
    return len(entries) if isinstance(entries[0], list) else 1


def check_fanout(body: dict[str, Any], fanout: Fanout, choices: int, max_choices: int) -> None:
    """A fanned-out body of P prompts with `choices` each runs P × `choices` sequences: at most
    `max_choices`, as a completions batch (400 otherwise, naming the field)."""
    count = fanned_out(body, fanout)
    if count is None or count * choices <= max_choices:
        return
    field = _FANOUT_FIELDS[fanout]
    message = (
        f"'{field}' is a batch of {count} conversations with {choices} choices each: this gateway "
        f"serves at most {max_choices} sequences per request"
    )
    raise ApiError(400, message, "invalid_request_error", "integer_above_max_value", field)
