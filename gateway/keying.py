"""The normalizer's answer for an admitted request, in its pool's mode.

A route with a prompt is canonicalized (approximate on the event loop, tokenizer mode on the
normalizer's thread, render mode through a worker's render endpoint); a pass-through route has
nothing to key, and is sized from its body so that quotas and load accounting still see it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from gateway.bodies import missing_model
from gateway.errors import ApiError
from gateway.registry import Pool
from gateway.render import render_canonical
from gateway.routes import ApiRoute
from gateway.state import GatewayState
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.types import CanonicalPrompt, KeyIdentity


async def canonical_prompt(
    api: ApiRoute,
    raw: bytes,
    body: dict[str, Any],
    state: GatewayState,
    pool: Pool,
    identity: KeyIdentity,
    public: KeyIdentity | None,
    request_id: str,
) -> CanonicalPrompt:
    """Keys, zones and size of one request; 400 on a prompt the normalizer cannot read."""
    normalizer = state.normalizer(pool)
    prompt = api.prompt
    if prompt is None:
        # Nothing to key: the policy routes on load. JSON inputs count as approximate tokens of
        # their body; an audio file counts for nothing (its cost is not in tokens).
        n_tokens = 0 if api.multipart else len(raw) // normalizer.config.chars_per_token
        return CanonicalPrompt(n_tokens, pool.config.block_size_tokens, (), ())
    try:
        if normalizer.config.mode == "render":
            try:
                plan = normalizer.prepare_render(prompt, body)
            except NormalizerError as exc:
                if exc.code != "render_empty":
                    raise
                return normalizer.canonicalize(prompt, body, identity, public)  # nothing to render
            session = state.upstream()
            return await render_canonical(normalizer, plan, pool, session, identity, public, request_id)
        if normalizer.config.mode == "tokenizer":
            # Tokenizing and templating a long prompt takes milliseconds: off the event loop, on
            # the normalizer's one thread (so a Normalizer is never entered concurrently).
            return await asyncio.get_running_loop().run_in_executor(
                state.normalizer_executor(),
                functools.partial(normalizer.canonicalize, prompt, body, identity, public),
            )
        return normalizer.canonicalize(prompt, body, identity, public)
    except NormalizerError as exc:
        raise prompt_error(exc) from None


def prompt_error(exc: NormalizerError) -> ApiError:
    """A prompt the normalizer cannot read: 400, naming the field."""
    return ApiError(400, exc.message, "invalid_request_error", exc.code, exc.param)


def only_model(state: GatewayState) -> str:
    """The model of a request that names none: the gateway's only one (as vLLM takes its own)."""
    served = list(state.registry.by_model)
    if len(served) != 1:
        raise missing_model(served)
    return served[0]
