"""What a worker's answer says it used: its `usage` object, in each of the shapes it comes in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.records import record


@record
class Usage:
    """Token counts a worker reported; None where it reported nothing, or no count (not an integer,
    or below zero)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


NO_USAGE = Usage()


def usage_of(raw: Any) -> Usage:
    """A worker's `usage` in any of the three shapes it comes in: chat and completions
    (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), Responses (`input_tokens`,
    `input_tokens_details.cached_tokens`) and Anthropic Messages (`input_tokens` is the uncached
    rest: the prompt is it plus `cache_read_input_tokens` and `cache_creation_input_tokens`, and
    the read part is the cached one)."""
    # `type(...) is dict` first: the answer's own JSON objects are dicts, and the ABC check
    # alone costs more than the rest of a usage read.
    if type(raw) is not dict and not isinstance(raw, Mapping):
        return Usage()
    prompt = raw.get("prompt_tokens")
    if prompt is None and "input_tokens" in raw:
        return _input_usage(raw)
    details = raw.get("prompt_tokens_details")
    cached = None
    if type(details) is dict or isinstance(details, Mapping):
        cached = details.get("cached_tokens")
    return Usage(_int(prompt), _int(raw.get("completion_tokens")), _int(cached))


def _input_usage(raw: Mapping[str, Any]) -> Usage:
    prompt = _int(raw.get("input_tokens"))
    read = _int(raw.get("cache_read_input_tokens"))
    created = _int(raw.get("cache_creation_input_tokens"))
    details = raw.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else read
    if prompt is not None and (read is not None or created is not None):
        prompt += (read or 0) + (created or 0)
    return Usage(prompt, _int(raw.get("output_tokens")), cached)


def _int(value: Any) -> int | None:
    """A count as the worker reported it, or None where it is not one: a count below zero (a
    faulty worker's) is as absent as a string, or it would take a token counter down and give a
    tenant back tpm it spent (`TenantLimiter.reconcile`)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
