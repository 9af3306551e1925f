"""The bodies of a split request's two legs, as docs/pd.md ("Wire protocols") gives them.

vLLM's prefill leg asks for remote decode with `max_tokens` 1 and no streaming, and its decode
leg carries what the prefill returned; SGLang's legs both carry `bootstrap_host`,
`bootstrap_port` and `bootstrap_room`. A prefill leg keeps what the client's own request is
refused on, so that the prefill worker refuses it before any KV is held for a decode leg that
would be refused too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.admitted import Admitted
from policies.base import RouteDecision
from policies.identity import cache_salt_for
from prompt_normalizer.lax import lax_int

# What vLLM's proxy puts in the prefill leg: "decode this elsewhere".
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _base(a: Admitted, decision: RouteDecision) -> dict[str, Any]:
    salt = cache_salt_for(a.route, decision.shared_prefix_blocks, a.tenant.cache_salt, a.public_salt)
    return {**a.forward, a.api.salt_field: salt}


def _refused(fields: dict[str, Any], budget: _Budget) -> bool:
    """Whether the engine refuses the output budget or `min_tokens` of `fields` (a body, or its
    `sampling_params`) as the client sent them, read as vLLM reads them: a budget field (`names`)
    that is not an integer in lax mode; a budget below 1 (the first field set to a non-zero value,
    else the last: `max_completion_tokens or max_tokens`); a `min_tokens` that is not an integer,
    below 0, or above the budget (the engine's default for the route when none is set)."""
    values: list[int | None] = []
    for name in budget.names:
        raw = fields.get(name)
        value = None if raw is None else lax_int(raw)
        if raw is not None and value is None:
            return True
        values.append(value)
    limit = next((v for v in values if v), values[-1] if values else None)
    if limit is not None and limit < 1:
        return True
    if "min_tokens" not in fields:
        return False
    if limit is None:
        limit = budget.default
    minimum = lax_int(fields["min_tokens"])
    return minimum is None or minimum < 0 or (limit is not None and minimum > limit)


def _as_prefill(body: dict[str, Any], streamed: bool, budget: _Budget) -> dict[str, Any]:
    """The prefill leg's body: not streamed, without `stream_options` when the client streams
    (vLLM refuses it without streaming) and without `min_tokens` (a minimum length would make
    the one-token prefill run on; vLLM's proxy also drops `min_completion_tokens`, which neither
    engine reads). What the client's request is itself refused on stays as sent: its
    `stream_options` when it does not stream, and a budget or `min_tokens` the engine refuses
    (`_refused`), so the prefill worker refuses the request as the decode worker would. A decode
    leg refused after the prefill worker computed the prompt would leave the prompt's KV held
    there for a decode leg that never comes (vLLM: up to `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`,
    480 s)."""
    if streamed:
        body.pop("stream_options", None)
    if not _refused(body, budget):
        body.pop("min_tokens", None)
    body.pop("min_completion_tokens", None)
    body["stream"] = False
    return body


def _one_token(fields: dict[str, Any], budget: _Budget) -> dict[str, Any]:
    """`fields` asking for one output token: `max_tokens` 1, and `max_completion_tokens` 1 when
    present; as sent when the engine refuses their budget or `min_tokens` (`_refused`)."""
    if not _refused(fields, budget):
        fields["max_tokens"] = 1
        if "max_completion_tokens" in fields:
            fields["max_completion_tokens"] = 1
    return fields


@dataclass(frozen=True, slots=True)
class _Budget:
    """Where the route's engine reads the output budget, and its own when the client sets none
    (None: the context window's rest, which the gateway does not judge here)."""

    names: tuple[str, ...]
    default: int | None = None


_NO_BUDGET = _Budget(())


def _budget_fields(a: Admitted) -> _Budget:
    """vLLM's chat reads `max_completion_tokens`, else `max_tokens` (by default the context
    window's rest); its completions and native generate read `max_tokens`, 16 by default."""
    if a.api.prompt == "chat":
        return _Budget(("max_completion_tokens", "max_tokens"))
    return _Budget(("max_tokens",), 16 if a.api.prompt in ("completions", "generate") else None)


def vllm_prefill_body(a: Admitted, decision: RouteDecision) -> bytes:
    body = _base(a, decision)
    budget = _budget_fields(a)
    if a.api.prompt == "generate":
        # `/inference/v1/generate` takes its output budget in `sampling_params`.
        _as_prefill(body, a.stream, _NO_BUDGET)
        sent = body.get("sampling_params")
        if sent is None or isinstance(sent, dict):  # else refused as sent, by the prefill worker
            sampling = {**sent} if sent else {}
            if not _refused(sampling, budget):
                sampling.pop("min_tokens", None)
            body["sampling_params"] = _one_token(sampling, budget)
    else:
        _one_token(_as_prefill(body, a.stream, budget), budget)
    body["kv_transfer_params"] = _REMOTE_DECODE
    return orjson.dumps(body)


def vllm_decode_body(a: Admitted, decision: RouteDecision, params: dict[str, Any] | None) -> bytes:
    """The client's request with the prefill answer's `kv_transfer_params`; without them the
    decode worker computes the prompt itself (vLLM's rule too)."""
    body = _base(a, decision)
    if params is not None:
        body["kv_transfer_params"] = params
    return orjson.dumps(body)


def sglang_bodies(a: Admitted, decision: RouteDecision, bootstrap: dict[str, Any]) -> tuple[bytes, bytes]:
    """The prefill and decode legs: the same request and bootstrap fields; the prefill answer is
    only read for its usage, so it comes whole. A Responses prefill leg is not stored: the
    client's response is the decode worker's, and a copy under the same id on the prefill
    worker is one a follow-up could not continue."""
    decode = {**_base(a, decision), **bootstrap}
    prefill = _as_prefill(dict(decode), a.stream, _budget_fields(a))
    if a.api.prompt == "responses":
        prefill["store"] = False
    return orjson.dumps(prefill), orjson.dumps(decode)
