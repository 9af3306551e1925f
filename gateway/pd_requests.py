"""What a prefill/decode pool can do with a request, read from its body: whether it is one sequence
(a KV transfer carries one prompt's KV), and whether an SGLang pool could run it at all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import ApiError, bad_request
from gateway.registry import Pool
from policies.base import Role

# The fields that may carry a batch of prompts: completions' and SGLang's `/generate`'s (vLLM's
# `/inference/v1/generate` takes one sequence of `token_ids`).
_PROMPT_FIELDS = ("prompt", "text", "input_ids")


def splittable(body: Mapping[str, Any]) -> bool:
    """Whether a request is one sequence, as a KV transfer carries one prompt's KV: not several
    choices (`n`, `best_of`, at the top or in a native request's `sampling_params`) and not a
    batch of prompts (a completions `prompt`, SGLang's `text` or `input_ids`, listing more than
    one)."""
    params = body.get("sampling_params")
    for source in (body, params) if isinstance(params, Mapping) else (body,):
        for name in ("n", "best_of"):
            value = source.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return False
    for name in _PROMPT_FIELDS:
        prompt = body.get(name)
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            return False
    return True


def unrunnable(pool: Pool, generates: bool, body: Mapping[str, Any]) -> ApiError | None:
    """Why `pool` could never run this request (None: it could): in an SGLang pool, a generation
    request of several sequences runs whole on a mixed server, as SGLang's prefill and decode
    servers take only single-sequence pairs; a pool whose configuration lists its workers and
    no mixed one answers 400, not a 503 a client would retry. A pool that discovers its workers
    (DNS, Kubernetes, a workers file) may have a mixed one later: while it has none up, 503 as
    before."""
    config = pool.config
    pd = config.pd
    if pd is None or pd.protocol != "sglang" or not generates or splittable(body):
        return None
    if config.dns is not None or config.kubernetes is not None or config.workers_file is not None:
        return None
    roles = config.static_roles
    if any(Role.of(roles.get(url)) is Role.MIXED for url in config.static_urls):
        return None
    return bad_request(
        "this pool's SGLang prefill and decode servers run one sequence per request (n and best_of "
        "1, one prompt) and it has no mixed server to run a request of several whole",
        "n",
    )
