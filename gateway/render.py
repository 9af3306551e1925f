"""Render mode: ask a worker for the token ids of a request before routing it.

The normalizer stays pure; this module does the HTTP calls its `RenderPlan` asks for (the full
prompt, plus the zone-boundary prefixes, concurrently) against one healthy worker of the pool.
Each answer is read like a whole worker answer (`upstream.read_whole`): at most
`MAX_ANSWER_BYTES`, within the request's tenant's share of the process's answer budget. Past
it the request gets the gateway's 503 `gateway_overloaded`; a larger answer is the worker's
502.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gateway.answer_budget import AnswerHold
from gateway.errors import ApiError, upstream_error
from gateway.registry import Pool
from gateway.upstream import AnswerBudgetExceeded, UpstreamError, read_whole
from prompt_normalizer.normalizer import Normalizer
from prompt_normalizer.render import RenderPlan, parse_render_token_ids
from prompt_normalizer.types import CanonicalPrompt, KeyIdentity

_rotation = itertools.count()


async def render_canonical(
    normalizer: Normalizer,
    plan: RenderPlan,
    pool: Pool,
    session: aiohttp.ClientSession,
    identity: KeyIdentity,
    public: KeyIdentity | None,
    request_id: str,
    budget: AnswerHold,
) -> CanonicalPrompt:
    """Token ids from a worker's render endpoint, then keys; errors are OpenAI-shaped."""
    healthy = [w for w in pool.workers.values() if w.healthy]
    if not healthy:
        raise upstream_error(503, "no healthy worker available to render the prompt")
    url = healthy[next(_rotation) % len(healthy)].url + plan.render_path
    headers = {"content-type": "application/json", "x-request-id": request_id, **pool.auth.headers}
    main = _render(session, url, plan.body, headers, pool, budget, required=True)
    bounds = [
        _render(session, url, body, headers, pool, budget, required=False) if body is not None else _none()
        for body in plan.boundary_bodies
    ]
    results = await asyncio.gather(main, *bounds)
    tokens = results[0]
    assert tokens is not None
    return normalizer.from_render(plan, tokens, identity, public, boundary_token_ids=results[1:])


async def _none() -> None:
    return None


async def _render(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: dict[str, str],
    pool: Pool,
    budget: AnswerHold,
    *,
    required: bool,
) -> Any:
    try:
        async with session.post(
            url, data=orjson.dumps(body), headers=headers, timeout=pool.client_timeout
        ) as resp:
            payload = await read_whole(resp.content.readany, budget)
            status = resp.status
    except AnswerBudgetExceeded as exc:
        if not required:
            return None
        raise ApiError(
            503, f"{exc}; retry shortly", "server_error", "gateway_overloaded", None, {"retry-after": "1"}
        ) from None
    except UpstreamError as exc:  # the answer passed the per-answer cap
        if not required:
            return None
        raise upstream_error(502, f"the worker's render answer could not be read ({exc})") from None
    except TimeoutError:
        if not required:
            return None
        raise upstream_error(504, "the worker did not render the prompt in time") from None
    except (aiohttp.ClientError, OSError) as exc:
        if not required:
            return None
        raise upstream_error(
            502, f"could not reach a worker to render the prompt ({type(exc).__name__})"
        ) from None
    if status != 200:
        if not required:
            return None
        if 400 <= status < 500:
            raise ApiError(status, _worker_message(payload), "invalid_request_error", "render_rejected")
        raise upstream_error(502, f"the worker answered {status} to the render call")
    try:
        return parse_render_token_ids(orjson.loads(payload))
    except (orjson.JSONDecodeError, ValueError):
        if not required:
            return None
        raise upstream_error(502, "the worker's render answer has no token ids") from None


def _worker_message(payload: bytes) -> str:
    try:
        obj = orjson.loads(payload)
        message = obj["error"]["message"] if isinstance(obj.get("error"), dict) else obj.get("message")
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        message = None
    return (
        f"the worker rejected the prompt: {message}"
        if isinstance(message, str)
        else "the worker rejected the prompt"
    )
