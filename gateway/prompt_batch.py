"""Batched prompts: one completions or native generate request may carry several prompts (a list
of strings, or of token-id lists), each decoded with every choice it asks for. The normalizer
keys the first (`prompt_normalizer.completions`), so what the batch adds is counted here: the
sequences it decodes against `limits.max_choices`, and its prompts' size in the tokens the
tenant's tpm quota and the worker's load count.

A load-aware route may fan out too (`routes.Fanout`): vLLM's batch of chat completions decodes
each conversation of its `messages`, each with the chat budget, and vLLM's reads prefill one
prompt per item or question (`/generative_scoring`: the query and one item; `/v1/systemone`: the
state, its instructions and one question; `/v1/decisions`: the input and one question). Those
prompts count as the sequences of a completions batch do, and what each read repeats counts in
the prompt tokens once per read: the body alone counts it once, and a 7 KB scoring request of 300
items prefilled a million tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import ApiError
from gateway.pooling_inputs import pooling_tokens
from gateway.routes import Fanout, Pooled
from prompt_normalizer.generate_input import GENERATE_PROMPT_FIELDS


def batch_sizes(body: dict[str, Any], prompt: str | None) -> list[int] | None:
    """Each prompt's size (characters, or token ids) when the request batches two or more; None
    for one prompt (a string, or one list of token ids)."""
    batch = _batch(body, prompt)
    if batch is None:
        return None
    kind = str if isinstance(batch.entries[0], str) else list
    return [len(e) if isinstance(e, kind) else 0 for e in batch.entries]


@dataclass(frozen=True, slots=True)
class _Batch:
    """Two or more prompts, and the body field that holds them (what an error names)."""

    field: str
    entries: list[Any]


def _batch(body: dict[str, Any], prompt: str | None) -> _Batch | None:
    field: str | None = None
    if prompt == "completions":
        field = "prompt"
    elif prompt == "generate":
        # The first field that holds a non-empty list (`text` may be a string beside `input_ids`).
        listed = (f for f in GENERATE_PROMPT_FIELDS if isinstance(body.get(f), list) and body[f])
        field = next(listed, None)
    if field is None:
        return None
    entries = body.get(field)
    if not isinstance(entries, list) or len(entries) < 2 or not isinstance(entries[0], str | list):
        return None  # one prompt: a string, or the token ids of one
    return _Batch(field, entries)


def check_sequences(body: dict[str, Any], prompt: str | None, choices: int, max_choices: int) -> None:
    """A batch of B prompts with `choices` each decodes B × `choices` sequences: at most
    `max_choices`, as one prompt's `n` is (400 otherwise, naming the prompt field)."""
    batch = _batch(body, prompt)
    if batch is None or len(batch.entries) * choices <= max_choices:
        return
    message = (
        f"'{batch.field}' is a batch of {len(batch.entries)} prompts with {choices} choices each: "
        f"this gateway serves at most {max_choices} sequences per request"
    )
    raise ApiError(400, message, "invalid_request_error", "integer_above_max_value", batch.field)


def batch_tokens(
    body: dict[str, Any],
    prompt: str | None,
    first_tokens: int,
    chars_per_token: int,
    fanout: Fanout | None = None,
    pooled: Pooled | None = None,
) -> int:
    """The batch's prompt tokens: the first prompt's (`first_tokens`, the normalizer's count), and
    each other one estimated on its own: its token ids, or its characters at `chars_per_token`
    (the pool's approximate rate; the worker's `usage` corrects the tenant's quota when it ends).
    `first_tokens` for one prompt. On a route that fans out (`fanout`), `first_tokens` is the
    body's and what its reads repeat is added (`fanout_tokens`); on a pooling route (`pooled`),
    what its pairs repeat (`pooling_inputs.pooling_tokens`)."""
    if fanout is not None:
        return fanout_tokens(body, fanout, first_tokens, chars_per_token)
    if pooled is not None:
        return pooling_tokens(body, pooled, first_tokens, chars_per_token)
    batch = _batch(body, prompt)
    if batch is None:
        return first_tokens
    rest = 0
    for entry in batch.entries[1:]:
        if isinstance(entry, str):
            rest += -(-len(entry) // chars_per_token)
        elif isinstance(entry, list):
            rest += len(entry)
    return first_tokens + rest


# The field of a fanned-out body that lists the prompts its worker runs one by one, and what it
# calls one of them in an error.
_FANOUT_FIELDS: dict[Fanout, tuple[str, str]] = {
    "conversations": ("messages", "conversations"),
    "items": ("items", "items"),
    "state_questions": ("questions", "questions"),
    "input_questions": ("questions", "questions"),
}

# The fields of a read's body that every one of its prompts holds (the worker prefills them once
# per item or question; its prefix cache may spare part of that, which the worker's `usage`
# tells when the request ends).
_SHARED_FIELDS: dict[Fanout, tuple[str, ...]] = {
    "conversations": (),
    "items": ("query",),
    "state_questions": ("state", "instructions"),
    "input_questions": ("input",),
}


def fanned_out(body: dict[str, Any], fanout: Fanout) -> int | None:
    """How many prompts a fanned-out body (`routes.Fanout`) runs: the conversations of a batch of
    chat completions (a list of message lists; a list of messages is one conversation, as one
    prompt of a completions batch is), the items or questions of a read (`/v1/systemone` keys its
    questions by id, in an object); None when the field is not a non-empty list or object (the
    worker's 400)."""
    entries = body.get(_FANOUT_FIELDS[fanout][0])
    if fanout == "conversations":
        if not isinstance(entries, list) or not entries:
            return None
        return len(entries) if isinstance(entries[0], list) else 1
    return len(entries) if isinstance(entries, list | dict) and entries else None


def check_fanout(body: dict[str, Any], fanout: Fanout, choices: int, max_choices: int) -> None:
    """A fanned-out body of P prompts with `choices` each runs P × `choices` sequences: at most
    `max_choices`, as a completions batch (400 otherwise, naming the field)."""
    count = fanned_out(body, fanout)
    if count is None or count * choices <= max_choices:
        return
    field, kind = _FANOUT_FIELDS[fanout]
    if fanout == "conversations":
        message = (
            f"'{field}' is a batch of {count} conversations with {choices} choices each: this "
            f"gateway serves at most {max_choices} sequences per request"
        )
    else:
        message = (
            f"'{field}' holds {count} {kind}, each read as a prompt of its own: this gateway serves "
            f"at most {max_choices} {kind} per request"
        )
    raise ApiError(400, message, "invalid_request_error", "integer_above_max_value", field)


def fanout_tokens(body: dict[str, Any], fanout: Fanout, body_tokens: int, chars_per_token: int) -> int:
    """A fanned-out body's prompt tokens: the body's own (`body_tokens`, every item or question
    once), and what every read repeats (`_SHARED_FIELDS`) once more for each read past the first."""
    shared = _SHARED_FIELDS[fanout]
    count = fanned_out(body, fanout) if shared else None
    if count is None or count < 2:
        return body_tokens
    each = sum(_tokens(body.get(name), chars_per_token) for name in shared)
    return body_tokens + (count - 1) * each


def _tokens(value: object, chars_per_token: int) -> int:
    """The approximate tokens of a field: a string's characters at `chars_per_token`, a list of
    token ids its length, anything else (a state or input given as messages or an object) its
    JSON at `chars_per_token`."""
    if value is None:
        return 0
    if isinstance(value, str):
        return -(-len(value) // chars_per_token)
    if isinstance(value, list) and value and isinstance(value[0], int):
        return len(value)
    return -(-len(orjson.dumps(value)) // chars_per_token)
