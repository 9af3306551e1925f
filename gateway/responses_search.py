"""The search for the worker holding a stored response this process does not know.

A follow-up naming the tenant's own id (`responses_follow_up.locate_previous`) and a `GET` or
`cancel` of one (`responses_routes`, in the pool its id names: `pools_to_search`) look with the
one search, `find_holder`, and a worker holds
the response when it answers a `GET` of it 200 (`holds`): another pool's worker may answer
anything else (vLLM's 400 where its model serves no Responses API). A prefill worker of a
prefill/decode pool is never asked (`may_hold`): the client's response is the decode worker's,
though an SGLang prefill leg carries the same id. A worker that could not tell (busy,
unreachable, too slow, unhealthy) is no proof of absence: when no other worker holds the
response, the client gets a 503 with `Retry-After` (the busy worker's), which it may retry, never
a 404, which it would not. The search is bounded in time (`ASK_S` per worker, `SEARCH_S` in all).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Literal, TypeVar
from urllib.parse import quote

import aiohttp

from gateway.errors import ApiError
from gateway.failure import BUSY_STATUSES, REFUSED_CREDENTIALS, Failure, worker_status
from gateway.registry import Pool, Registry
from gateway.responses_ids import ResponseIds
from gateway.upstream_headers import answer_hints
from gateway.worker import Worker
from policies.base import Outcome, Role

Headers = Mapping[str, str] | Sequence[tuple[str, str]]


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Found(Generic[T]):
    """The worker found holding a stored response, its pool, and what asking it returned."""

    pool: Pool
    worker: Worker
    answer: T


def stored_url(worker_url: str, response_id: str, suffix: str = "") -> str:
    """The URL of stored response `response_id` on a worker (`suffix`: "" or "/cancel")."""
    return f"{worker_url}/v1/responses/{quote(response_id, safe='')}{suffix}"


# The search for a holder (`find_holder`) is bounded in time: each worker's answer within
# `ASK_S` (and the pool's own `read_s`, when shorter), the whole search within `SEARCH_S`. A worker
# answers a `GET` of a stored response from memory: the pool's `read_s`, which covers a whole
# generation (600 s), would let one hung worker hold the client for minutes.
ASK_S = 10.0
SEARCH_S = 30.0


class Undecided(Exception):
    """A worker asked in the search could not tell whether it holds the response: it is busy
    (its 503 or 529, `failure` carrying its `Retry-After`). Not proof that it does not."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def ask_timeout(pool: Pool) -> aiohttp.ClientTimeout:
    """The bound on one worker's answer in the search: `ASK_S`, or the pool's shorter timeouts."""
    t = pool.config.timeouts
    ask_s = min(ASK_S, t.read_s, t.total_s)
    return aiohttp.ClientTimeout(total=ask_s + t.connect_s, sock_connect=t.connect_s, sock_read=ask_s)


async def holds(
    session: aiohttp.ClientSession, pool: Pool, worker: Worker, response_id: str, headers: Headers
) -> Literal[True] | None:
    """True when `worker` holds stored response `response_id` (None otherwise, for `find_holder`):
    it answers a plain `GET` of it 200 (body unread). A busy worker (its 503 or 529) may hold it:
    `Undecided`, with its `Retry-After`. Any other answer says nothing about where the response
    is: vLLM's 404 when it does not hold it, and its 400 on every `/v1/responses/{id}` route when
    its model serves no Responses API (an embeddings pool). A worker refusing the gateway's
    credentials ends the search with 502 `worker_auth_failed` (a misconfigured worker key, told as
    such rather than as a response not found). The answer is bounded by `ask_timeout`."""
    url = stored_url(worker.url, response_id)
    async with session.get(url, headers=headers, timeout=ask_timeout(pool)) as resp:
        if resp.status in REFUSED_CREDENTIALS:
            raise worker_status(resp.status).error()
        if resp.status in BUSY_STATUSES:
            raise Undecided(worker_status(resp.status, answer_hints(resp.headers)))
        return True if resp.status == 200 else None


def may_hold(pool: Pool, worker: Worker) -> bool:
    """Whether `worker` may hold a client's stored response: any worker but the prefill worker
    of a prefill/decode pool. A response is the answer of the worker that answers the client, a
    decode or mixed one (a Responses request under vLLM runs on one worker alone); but a split
    under SGLang sends both legs one body, so the prefill worker, if it stores responses, keeps a
    copy under the same id, which a follow-up could not continue there."""
    return pool.pd_router is None or Role.of(worker.role) is not Role.PREFILL


def pools_to_search(ids: ResponseIds, registry: Registry, response_id: str) -> list[Pool]:
    """The pools whose workers may hold stored response `response_id` (one `ids` says is the
    asker's), in the registry's order: the pool serving the model its id names (its scope,
    `ResponseIds.scope_of`), the one that created it. Only their workers count in the search, so
    a worker down in another pool (an embeddings pool's, which never holds one) cannot turn the
    404 for an expired id into a 503. Every pool for an id without a scope (minted before ids had
    one) or one naming no model served now (its pool may have been renamed)."""
    pools = list(registry.pools.values())
    scope = ids.scope_of(response_id)
    if scope is None:
        return pools
    named = [pool for pool in pools if any(ids.scope(model) == scope for model in pool.config.models)]
    return named or pools


async def find_holder(
    pools: Iterable[Pool],
    ask: Callable[[Pool, Worker], Awaitable[T | None]],
    param: str | None = None,
    budget_s: float = SEARCH_S,
) -> Found[T] | None:
    """The holder of a stored response this process does not know: the workers of `pools` that
    may hold it (`may_hold`) are asked in turn, in the pools' and then the workers' order (`ask`:
    what the worker answered, None when it does not hold the response; `holds`), and the first
    answer that is not None ends the search. None only when every such worker said it does not
    hold it. A worker that could not tell is no proof of absence: busy (`Undecided`), unreachable,
    without an answer in time, unhealthy (not asked), or not asked within `budget_s`. When no
    other worker holds the response, the search ends in a 503 (`param` names the field): with
    the first busy worker's `Retry-After` (`failure.worker_status`: `worker_overloaded` for its
    529) if one was busy, else `worker_unavailable` with the gateway's 1 s. The client may try
    again; a 404 it would not (the OpenAI SDKs retry a 503, never a 404)."""
    deadline_s = time.monotonic() + budget_s
    undecided: Failure | None = None  # why a worker that may hold it could not tell (busy first)
    for pool in tuple(pools):
        for worker in tuple(pool.workers.values()):
            if not may_hold(pool, worker):
                continue
            left_s = deadline_s - time.monotonic()
            if not worker.healthy or left_s <= 0:
                undecided = undecided or _UNASKED
                continue
            try:
                async with asyncio.timeout(left_s):
                    answer = await ask(pool, worker)
            except Undecided as busy:
                if undecided is None or not undecided.later:
                    undecided = busy.failure
                continue
            except (TimeoutError, aiohttp.ClientError, OSError):
                undecided = undecided or _UNASKED
                continue
            if answer is not None:
                return Found(pool, worker, answer)
    if undecided is not None:
        raise _undecided(undecided, param)
    return None


# A worker that may hold the response but was not asked (unhealthy) or did not answer (unreachable,
# timed out): the client is told to try again after the gateway's 1 s.
_UNASKED = Failure(
    503,
    "a worker that may hold it could not be asked (unhealthy, unreachable or no answer in time)",
    "worker_unavailable",
    Outcome.ABORTED,
)


def _undecided(failure: Failure, param: str | None) -> ApiError:
    """The search's end when no worker holds the response and one could not tell: a 503 (the
    busy worker's `Retry-After`, or 1 s) saying that the response may exist."""
    reason = (
        failure.message if failure is _UNASKED else f"a worker that may hold it is busy ({failure.message})"
    )
    message = f"could not tell whether the response exists: {reason}; try again later"
    return replace(failure, message=message, param=param).error()
