"""The body fields a tenant may not set, because they steer an engine's internals rather than the
answer, and the walk over a native generate request's `sampling_params` (one object, or one per
prompt of a batch) that finds them and the other per-prompt fields."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn

from gateway.errors import bad_request

# Body fields that steer an engine's internals rather than the answer. A tenant must not set them:
# `kv_transfer_params` (vLLM disaggregated prefill: where KV is pulled from or pushed to), `rid`
# (SGLang's engine request id; the gateway names requests itself), `data_parallel_rank` and SGLang's
# newer rank fields (pin an engine rank), `bootstrap_host` / `bootstrap_port` / `bootstrap_room`
# (SGLang prefill-decode transfer), `prompt_embeds` and SGLang's `input_embeds` (bypass
# tokenization, so the prefix keys could not describe the prompt). They are refused with 400, naming
# the field. vLLM's own `request_id` is passed through: the gateway's `X-Request-Id` header names
# the request inside vLLM whatever the body says (on the Responses route `request_id` names the
# response). `priority` is read (it orders the tenant's own requests in the gateway's queue) and
# never forwarded as sent: engines order every tenant's requests by it, so the gateway sends the
# tenant's own (`engine_priority`). `cache_salt` is not refused: the gateway always replaces it with
# its own.
ENGINE_INTERNAL_FIELDS = frozenset(
    {
        "kv_transfer_params",
        "rid",
        "data_parallel_rank",
        # SGLang's newer names for the data-parallel rank a request runs on (and, in a P/D pair,
        # the prefill rank its KV comes from): a tenant must not pin its load on one rank.
        "routed_dp_rank",
        "prefill_dp_rank",
        "decode_dp_rank",
        "disagg_prefill_dp_rank",
        # SGLang: serialized code the engine runs (when it allows it), and engine-side sessions.
        "custom_logit_processor",
        "session_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "prompt_embeds",
        "input_embeds",
    }
)

# The engine-internal fields an engine also reads from inside another field, where a check of the
# top-level keys alone would not see them. vLLM's chat, completions and Responses requests start a
# request's `SamplingParams.extra_args` from `vllm_xargs` (`to_sampling_params`), and its
# `/inference/v1/generate` takes `sampling_params` as sent, `extra_args` included; the engine's
# request then reads `kv_transfer_params` from `extra_args` (`vllm.v1.request.Request`), as the KV
# connectors do (LMCache's per-request options are keys inside it). Any other key of
# `extra_args` is for the operator's own logits processors and plugins, and is forwarded.
NESTED_ENGINE_INTERNAL_FIELDS = frozenset({"kv_transfer_params"})


def sampling_entries(body: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each object of the body's `sampling_params` with its path: `sampling_params` for one
    object, `sampling_params[i]` for the entries of a list (one per prompt of a batch)."""
    sampling = body.get("sampling_params")
    if isinstance(sampling, dict):
        yield "sampling_params", sampling
    elif isinstance(sampling, list):
        for i, entry in enumerate(sampling):
            if isinstance(entry, dict):
                yield f"sampling_params[{i}]", entry


def check_internal(body: dict[str, Any]) -> None:
    """400 for an engine-internal field at the body's top level (`ENGINE_INTERNAL_FIELDS`)."""
    if not ENGINE_INTERNAL_FIELDS.isdisjoint(body):
        _refuse(min(ENGINE_INTERNAL_FIELDS.intersection(body)))


def check_nested_internal(body: dict[str, Any]) -> None:
    """400 for an engine-internal field inside `vllm_xargs` or `sampling_params.extra_args` (one
    object, or one per prompt of a batch), as at the top level
    (`NESTED_ENGINE_INTERNAL_FIELDS`): the engine reads it from there the same way. Checked on
    every route, as the top-level fields are."""
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and not NESTED_ENGINE_INTERNAL_FIELDS.isdisjoint(xargs):
        _refuse("vllm_xargs." + min(NESTED_ENGINE_INTERNAL_FIELDS.intersection(xargs)))
    for path, entry in sampling_entries(body):
        extra = entry.get("extra_args")
        if isinstance(extra, dict) and not NESTED_ENGINE_INTERNAL_FIELDS.isdisjoint(extra):
            _refuse(f"{path}.extra_args." + min(NESTED_ENGINE_INTERNAL_FIELDS.intersection(extra)))


def _refuse(name: str) -> NoReturn:
    raise bad_request(f"'{name}' is an engine-internal field and cannot be set through the gateway", name)
