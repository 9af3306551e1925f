"""Replay a request list over HTTP at its arrival times (aiohttp, streamed, bounded).

Each request is sent at `arrival_s / time_scale` after the start, at most `max_in_flight` at once
(a request due while the limit is reached waits, and the wait counts in its TTFT, as a user would
see it); nothing is sent after `time_limit_s`, and anything still open at `time_limit_s + grace`
is cancelled and recorded as an error. TTFT is the time to the first streamed chunk that carries
generated content; usage (prompt, cached and completion tokens) comes from the final chunk.

With `spread_urls`, the client is its own L4 balancer: it holds `max_in_flight` keep-alive
connections, connection j to `spread_urls[j % len]`, and a request takes the connection freed
longest ago. Requests thus cycle over every connection (and so over every URL, or, for one URL
served by several processes with SO_REUSEPORT, over the processes the kernel gave the connections).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from loadtest.workloads.openai_body import openai_request
from loadtest.workloads.records import WorkloadRequest


@dataclass(frozen=True, slots=True)
class HttpResult:
    """What the client saw for one request. Times are seconds from the replay's start.

    `sent_s` is when the request was due (its scaled arrival time); `queued_s` how long it then
    waited for a client slot. TTFT and e2e count from `sent_s`, so a slow router is charged for
    the backlog it causes (no coordinated omission).
    """

    request_id: str
    tenant: str
    sent_s: float
    queued_s: float
    ttft_s: float | None
    e2e_s: float | None
    status: int
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    base_url: str
    model: str
    time_scale: float = 1.0
    max_in_flight: int = 128
    time_limit_s: float = 300.0
    grace_s: float = 60.0
    request_timeout_s: float = 300.0
    spread_urls: tuple[str, ...] = ()  # when set: pinned connections over these (base_url unused)


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _has_content(chunk: dict[str, object]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    c = choices[0]
    if not isinstance(c, dict):
        return False
    if c.get("text"):
        return True
    delta = c.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("tool_calls"))


async def _one(
    session: aiohttp.ClientSession,
    cfg: ReplayConfig,
    req: WorkloadRequest,
    headers: dict[str, str],
    t0: float,
    sent: float,
    base_url: str | None = None,
) -> HttpResult:
    wire = openai_request(req, cfg.model)
    queued = time.monotonic() - t0 - sent
    first: float | None = None
    usage: dict[str, object] = {}
    url = (base_url or cfg.base_url) + wire.path
    try:
        async with session.post(url, json=wire.body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return HttpResult(
                    req.request_id, req.tenant, sent, queued, None, None, resp.status, text, 0, 0, 0
                )
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = orjson.loads(payload)
                if first is None and _has_content(chunk):
                    first = time.monotonic() - t0
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: bad JSON, oversized line
        return HttpResult(
            req.request_id, req.tenant, sent, queued, None, None, 0, type(exc).__name__, 0, 0, 0
        )
    end = time.monotonic() - t0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    return HttpResult(
        req.request_id,
        req.tenant,
        sent,
        queued,
        None if first is None else first - sent,
        end - sent,
        200,
        None if first is not None else "no content streamed",
        _int(usage.get("prompt_tokens")),
        _int(cached),
        _int(usage.get("completion_tokens")),
    )


async def replay(
    requests: Sequence[WorkloadRequest],
    cfg: ReplayConfig,
    headers_for: Callable[[WorkloadRequest], dict[str, str]],
    progress: Callable[[int], None] | None = None,
) -> list[HttpResult]:
    """Send every request at its (scaled) arrival time; returns one result per request sent."""
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    if cfg.spread_urls:
        n = cfg.max_in_flight
        sessions = [
            aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1)) for _ in range(n)
        ]
        slots = [(s, cfg.spread_urls[j % len(cfg.spread_urls)]) for j, s in enumerate(sessions)]
    else:
        connector = aiohttp.TCPConnector(limit=cfg.max_in_flight)
        slots = [(aiohttp.ClientSession(timeout=timeout, connector=connector), cfg.base_url)]
    try:
        return await _replay(requests, cfg, headers_for, progress, slots)
    finally:
        await asyncio.gather(*(s.close() for s, _ in slots))


async def _replay(
    requests: Sequence[WorkloadRequest],
    cfg: ReplayConfig,
    headers_for: Callable[[WorkloadRequest], dict[str, str]],
    progress: Callable[[int], None] | None,
    slots: list[tuple[aiohttp.ClientSession, str]],
) -> list[HttpResult]:
    """The replay over `slots`: one shared pool (one slot, `max_in_flight` requests at once on it)
    or pinned connections (one request at a time on each, taken in the order they were freed)."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    t_first = ordered[0].arrival_s if ordered else 0.0
    limit = asyncio.Semaphore(cfg.max_in_flight)
    pinned = bool(cfg.spread_urls)
    free: asyncio.Queue[tuple[aiohttp.ClientSession, str]] = asyncio.Queue()
    for slot in slots if pinned else ():
        free.put_nowait(slot)
    results: list[HttpResult] = []
    t0 = time.monotonic()

    async def send(req: WorkloadRequest, due_s: float) -> None:
        async with limit:
            slot = await free.get() if pinned else slots[0]
            try:
                results.append(await _one(slot[0], cfg, req, headers_for(req), t0, due_s, slot[1]))
            finally:
                if pinned:
                    free.put_nowait(slot)
            if progress is not None:
                progress(len(results))

    tasks: list[asyncio.Task[None]] = []
    for req in ordered:
        due = (req.arrival_s - t_first) / cfg.time_scale
        if due > cfg.time_limit_s:
            break
        delay = due - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(req, due)))
    remaining = cfg.time_limit_s + cfg.grace_s - (time.monotonic() - t0)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(remaining, 0.1))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        done_ids = {r.request_id for r in results}
        for req in ordered[: len(tasks)]:
            if req.request_id not in done_ids:
                due = (req.arrival_s - t_first) / cfg.time_scale
                cancelled = "cancelled at time limit"
                results.append(
                    HttpResult(req.request_id, req.tenant, due, 0.0, None, None, 0, cancelled, 0, 0, 0)
                )
    return results
