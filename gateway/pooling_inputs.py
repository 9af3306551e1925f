"""The inputs of a pooling request: how many its worker encodes, and what each one repeats.

A pooling body is a list of inputs the worker encodes one by one (`routes.Pooled`): the inputs of
an embeddings, pooling or classify request, the documents of a rerank, the pairs of a score. Its
size in bytes says little about that work: 5,000 one-character inputs are 25 KB, and their
embeddings are an answer of 40 MB. So the inputs are counted against `limits.max_pooling_inputs`
(2,048 by default, the most OpenAI's embeddings API takes in one request), and what every pair of
a rerank or score repeats (its query) counts in the prompt tokens once per pair, as the reads'
shared fields do (`prompt_batch.fanout_tokens`): a cross-encoder encodes the query with each
document.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import ApiError
from gateway.routes import Pooled

# The two sides of a score request, in each of the shapes vLLM has taken (`text_1` / `text_2`,
# `data_1` / `data_2`, `queries` / `documents`): one side may be a single input, paired with each
# of the other's.
_SCORE_SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"))

# Cohere's embed request (vLLM's `/v2/embed`): each list holds inputs of its own kind.
_EMBED_V2_FIELDS = ("texts", "images", "inputs")

# SGLang's `/encode`: its text, or its token ids (one list of them, or one per input).
_ENCODE_FIELDS = ("text", "input_ids")


@dataclass(frozen=True, slots=True)
class PoolingInputs:
    """The inputs a pooling body asks its worker to encode: `count` of them, the largest list in
    `field`; `shared` names the field every one of them repeats (a rerank's query, the single side
    of a score), if any."""

    field: str
    count: int
    shared: str | None = None


def pooling_inputs(body: dict[str, Any], pooled: Pooled) -> PoolingInputs | None:
    """The inputs of a body of a pooling route (`routes.ApiRoute.pooled`); None when it names
    none the gateway can count (the worker's own 400 then, or one input as chat `messages`)."""
    if pooled == "input":
        return _one(body, "input")
    if pooled == "encode":
        return _largest(_one(body, name) for name in _ENCODE_FIELDS)
    if pooled == "embed_v2":
        found = [f for f in (_one(body, name) for name in _EMBED_V2_FIELDS) if f is not None]
        if not found:
            return None
        largest = max(found, key=lambda f: f.count)
        return PoolingInputs(largest.field, sum(f.count for f in found))
    if pooled == "rerank":
        return _rerank(body)
    if pooled == "score":
        return _score(body)
    # SageMaker's `/invocations` with a pooling body: any of vLLM's pooling request types.
    if "query" in body:
        return _rerank(body)
    return _largest((_one(body, "input"), _score(body), _rerank(body)))


def check_pooling_inputs(body: dict[str, Any], pooled: Pooled, max_inputs: int) -> None:
    """A pooling body of more than `max_inputs` inputs is refused with 400 naming its field."""
    found = pooling_inputs(body, pooled)
    if found is None or found.count <= max_inputs:
        return
    message = (
        f"'{found.field}' holds {found.count} inputs, each encoded on its own: this gateway serves at "
        f"most {max_inputs} inputs per request"
    )
    raise ApiError(400, message, "invalid_request_error", "array_above_max_length", found.field)


def pooling_tokens(body: dict[str, Any], pooled: Pooled, body_tokens: int, chars_per_token: int) -> int:
    """A pooling body's prompt tokens: the body's own (`body_tokens`, every input once), and
    the field every pair repeats once more for each pair past the first."""
    found = pooling_inputs(body, pooled)
    if found is None or found.shared is None or found.count < 2:
        return body_tokens
    shared = body.get(found.shared)
    if isinstance(shared, list) and len(shared) == 1:
        shared = shared[0]  # one input given as a list of one
    return body_tokens + (found.count - 1) * _tokens(shared, chars_per_token)


def _tokens(value: object, chars_per_token: int) -> int:
    """The approximate tokens of one input: a string's characters at `chars_per_token`, token ids
    one each, anything else (a multimodal input) its JSON's characters."""
    if isinstance(value, str):
        return -(-len(value) // chars_per_token)
    if isinstance(value, list) and value and isinstance(value[0], int):
        return len(value)
    return -(-len(orjson.dumps(value)) // chars_per_token)


def _count(value: object) -> int | None:
    """How many inputs a field holds: a string, or a list of token ids, is one; a list of strings,
    of token-id lists or of items is one each; vLLM's multimodal score input (an object with
    `content`) one per content part."""
    if isinstance(value, str):
        return 1
    if isinstance(value, list):
        if not value:
            return None
        return 1 if isinstance(value[0], int) else len(value)
    if isinstance(value, dict):
        content = value.get("content")
        return len(content) if isinstance(content, list) and content else 1
    return None


def _one(body: dict[str, Any], name: str) -> PoolingInputs | None:
    count = _count(body.get(name))
    return None if count is None else PoolingInputs(name, count)


def _largest(found: Iterable[PoolingInputs | None]) -> PoolingInputs | None:
    return max((f for f in found if f is not None), key=lambda f: f.count, default=None)


def _rerank(body: dict[str, Any]) -> PoolingInputs | None:
    documents = _one(body, "documents")
    if documents is None:
        return None
    return PoolingInputs("documents", documents.count, "query" if "query" in body else None)


def _score(body: dict[str, Any]) -> PoolingInputs | None:
    """The pairs of a score body: as many as its longer side holds (the other holds as many, or
    one input paired with each), in whichever of its shapes the body uses (the largest, if
    several)."""
    found = []
    for first, second in _SCORE_SIDES:
        a, b = _count(body.get(first)), _count(body.get(second))
        if a is None and b is None:
            continue
        a, b = a or 0, b or 0
        field = second if b >= a else first
        shared = first if a == 1 and b > 1 else second if b == 1 and a > 1 else None
        found.append(PoolingInputs(field, max(a, b), shared))
    return _largest(found)
