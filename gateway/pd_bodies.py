"""The bodies of a split request's two legs, as docs/pd.md ("Wire protocols") gives them.

vLLM's prefill leg asks for remote decode with `max_tokens` 1 and no streaming, and its decode
leg carries what the prefill returned; SGLang's legs both carry `bootstrap_host`,
`bootstrap_port` and `bootstrap_room`. A prefill leg keeps what the client's own request is
refused on, so that the prefill worker refuses it before any KV is held for a decode leg that
would be refused too.
"""

from __future__ import annotations

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


def _refused(fields: dict[str, Any], names: tuple[str, ...]) -> bool:
    """Whether the engine refuses the output budget or `min_tokens` of `fields` (a body, or its
    `sampling_params`) as the client sent them, read as vLLM reads them: a budget field (`names`)
    that is not an integer in lax mode; a budget below 1 (the first field set to a non-zero value,
    else the last: `max_completion_tokens or max_tokens`); a `min_tokens` that is not an integer,
    below 0, or above the budget."""
    values: list[int | None] = []
    for name in names:
        raw = fields.get(name)
        value = None if raw is None else lax_int(raw)
        if raw is not None and value is None:
            return True
        values.append(value)
    budget = next((v for v in values if v), values[-1] if values else None)
    if budget is not None and budget < 1:
        return True
    if "min_tokens" not in fields:
        return False
    minimum = lax_int(fields["min_tokens"])
    return minimum is None or minimum < 0 or (budget is not None and minimum > budget)


def _as_prefill(body: dict[str, Any], streamed: bool, names: tuple[str, ...]) -> dict[str, Any]:
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
    if not _refused(body, names):
        body.pop("min_tokens", None)
    body.pop("min_completion_tokens", None)
    body["stream"] = False
    return body


def _one_token(fields: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`fields` asking for one output token: `max_tokens` 1, and `max_completion_tokens` 1 when
    present; as sent when the engine refuses their budget or `min_tokens` (`_refused`)."""
    if not _refused(fields, names):
        fields["max_tokens"] = 1
        if "max_completion_tokens" in fields:
            fields["max_completion_tokens"] = 1
    return fields


def _budget_fields(a: Admitted) -> tuple[str, ...]:
    """Where the route's engine reads the output budget (vLLM's chat: `max_completion_tokens`,
    else `max_tokens`)."""
    return ("max_completion_tokens", "max_tokens") if a.api.prompt == "chat" else ("max_tokens",)


def vllm_prefill_body(a: Admitted, decision: RouteDecision) -> bytes:
    body = _base(a, decision)
    names = _budget_fields(a)
    if a.api.prompt == "generate":
        # `/inference/v1/generate` takes its output budget in `sampling_params`.
        _as_prefill(body, a.stream, ())
        sampling = body.get("sampling_params")
        sampling = {**sampling} if isinstance(sampling, dict) else {}
        if not _refused(sampling, names):
            sampling.pop("min_tokens", None)
        body["sampling_params"] = _one_token(sampling, names)
    else:
        _one_token(_as_prefill(body, a.stream, names), names)
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
