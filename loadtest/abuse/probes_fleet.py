"""Workers that fail under load (kill -9, SIGSTOP, a restart), a flood of unique prefixes against
the bounded index, and a tenant trying to see another tenant's cache."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadtest.abuse.client import CHAT, StreamReply, chat_body, post, stream, text
from loadtest.abuse.observe import RssPeak, admin_status, metrics, parse_metrics, routable, series, wait_for
from loadtest.abuse.probe import Context, Observation, Probe
from loadtest.abuse.report import mib
from loadtest.abuse.stack import (
    INDEX_MAX_ENTRIES,
    KEY_A,
    KEY_B,
    NAMESPACE_SHARE,
    READ_TIMEOUT_S,
    SOLO_MODEL,
    Worker,
)

STREAM_LIMIT_S = 45.0  # a stream still open after this is counted as hung
ROUTED_AGAIN_REQUESTS = 30
STOP_HOLD_S = READ_TIMEOUT_S + 3.0
FLOOD_PROMPT_CHARS = 2000
CROSS_PROMPT_CHARS = 4000
CROSS_VARIANTS: tuple[dict[str, Any], ...] = (
    {},
    {"cache_salt": "tenant-a"},
    {"prompt_cache_key": "shared"},
    {"user": "tenant-a"},
)


@dataclass
class LoadOutcome:
    """How a streaming load went through a worker failure."""

    complete: int
    errors: int
    hung: int
    in_flight_on_worker: float
    reached: bool  # the worker had streams when it was acted on (else the probe proved nothing)


async def _in_flight(ctx: Context, worker: Worker) -> float:
    samples = await metrics(ctx.session, ctx.stack)
    return series(samples, "kvgate_worker_in_flight", pool="main", worker=worker.url)


async def _under_streams(
    ctx: Context, tag: str, worker: Worker, act: Callable[[], Coroutine[Any, Any, None]]
) -> LoadOutcome:
    """Run the streaming load, and `act` on `worker` once it is under way; the worker's in-flight
    count is read just before and just after `act` begins (an upper bound of what it can lose)."""
    n, c = ctx.sizes.load_streams, ctx.sizes.load_concurrency
    gate = asyncio.Semaphore(c)
    first = asyncio.Event()

    async def one(i: int) -> StreamReply:
        async with gate:
            body = chat_body(text(f"{ctx.run_id}/{tag}/{i}", 200), 2 * ctx.sizes.stream_tokens, stream=True)
            if i == c - 1:
                first.set()  # the first wave has started
            return await stream(ctx.session, ctx.url(CHAT), KEY_B, body, timeout_s=STREAM_LIMIT_S)

    load = asyncio.gather(*(one(i) for i in range(n)))
    await first.wait()

    async def busy() -> bool:
        return await _in_flight(ctx, worker) >= 1

    reached, _ = await wait_for(busy, 10, 0.05)  # the worker has streams to lose
    await asyncio.sleep(0.3)  # and they are past their first events
    before = await _in_flight(ctx, worker)
    acting = asyncio.create_task(act())
    after = await _in_flight(ctx, worker)
    replies = await load
    await acting
    hung = sum(r.error == "TimeoutError" for r in replies)
    complete = sum(r.complete for r in replies)
    return LoadOutcome(complete, len(replies) - complete - hung, hung, max(before, after), reached)


async def _served_by(ctx: Context, worker: Worker) -> float:
    async with ctx.session.get(worker.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        samples = parse_metrics(await resp.text())
    return sum(
        series(samples, "vllm:request_success_total", finished_reason=reason) for reason in ("length", "stop")
    )


async def _routed_again(ctx: Context, worker: Worker, tag: str, since: float) -> tuple[bool, float, int, int]:
    """Wait until `worker` is routable again, then send requests until one reaches it: whether it
    became routable, how long after `since` (a monotonic time), how many requests it served and
    how many were sent."""
    back, _ = await wait_for(lambda: routable(ctx.session, ctx.stack, "main", worker.url), 30)
    after_s = time.monotonic() - since
    if not back:
        return False, after_s, 0, 0
    start = await _served_by(ctx, worker)
    sent = 0
    for i in range(ROUTED_AGAIN_REQUESTS):
        await post(
            ctx.session, ctx.url(CHAT), KEY_B, chat_body(text(f"{ctx.run_id}/{tag}/again/{i}", 400), 4)
        )
        sent += 1
        if await _served_by(ctx, worker) > start:
            break
    return True, after_s, int(await _served_by(ctx, worker) - start), sent


def _load_text(load: LoadOutcome, n: int) -> str:
    text = (
        f"{load.complete}/{n} streams complete, {load.errors} errors (in flight on it: "
        f"{load.in_flight_on_worker:.0f}), {load.hung} hung"
    )
    return text if load.reached else text + "; the worker got no stream within 10 s (routed elsewhere)"


def _load_ok(load: LoadOutcome) -> bool:
    return load.reached and load.hung == 0 and load.errors <= load.in_flight_on_worker


async def _kill_worker(ctx: Context) -> Observation:
    worker = ctx.stack.workers[0]

    async def kill() -> None:
        worker.signal(signal.SIGKILL)
        await asyncio.to_thread(worker.wait_exit, 10)

    load = await _under_streams(ctx, "kill", worker, kill)
    started = time.monotonic()
    await asyncio.to_thread(worker.start)
    back, after_s, served, sent = await _routed_again(ctx, worker, "kill", started)
    return Observation(
        f"{_load_text(load, ctx.sizes.load_streams)}; restarted: routable {after_s:.1f} s after "
        "its start, "
        f"served {served} of the next {sent}",
        _load_ok(load) and back and served >= 1,
    )


async def _stop_worker(ctx: Context) -> Observation:
    worker = ctx.stack.workers[1]
    before = series(
        await metrics(ctx.session, ctx.stack),
        "kvgate_upstream_retries_total",
        pool="main",
        reason="read_timeout",
    )

    continued = time.monotonic()

    async def stop_and_continue() -> None:
        nonlocal continued
        worker.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(STOP_HOLD_S)  # past the read timeout: what the probe is about
        finally:
            worker.signal(signal.SIGCONT)
            continued = time.monotonic()

    load = await _under_streams(ctx, "stop", worker, stop_and_continue)
    retries = (
        series(
            await metrics(ctx.session, ctx.stack),
            "kvgate_upstream_retries_total",
            pool="main",
            reason="read_timeout",
        )
        - before
    )
    back, after_s, served, sent = await _routed_again(ctx, worker, "stop", continued)
    return Observation(
        f"{_load_text(load, ctx.sizes.load_streams)}; {retries:.0f} read-timeout retries; after "
        f"SIGCONT routable within {after_s:.1f} s, served {served} of the next {sent}",
        _load_ok(load) and retries >= 1 and back and served >= 1,
    )


async def _restart_worker(ctx: Context) -> Observation:
    worker = ctx.stack.workers[2]
    restarted = asyncio.Event()
    statuses: list[int] = []

    async def client(k: int) -> None:
        i = 0
        while not restarted.is_set() and i < 200:
            body = chat_body(text(f"{ctx.run_id}/restart/{k}/{i}", 300), 16)
            statuses.append((await post(ctx.session, ctx.url(CHAT), KEY_B, body, timeout_s=30)).status)
            i += 1

    load = asyncio.gather(*(client(k) for k in range(4)))
    await asyncio.sleep(0.5)  # the load is under way
    worker.signal(signal.SIGTERM)
    code = await asyncio.to_thread(worker.wait_exit, 15)
    started = time.monotonic()
    await asyncio.to_thread(worker.start)
    back, after_s, _, _ = await _routed_again(ctx, worker, "restart-wait", started)
    restarted.set()
    await load
    _, _, served, sent = await _routed_again(ctx, worker, "restart", started)
    errors = sum(s != 200 for s in statuses)
    return Observation(
        f"{len(statuses)} requests across SIGTERM (exit {code}) and restart: {errors} errors; "
        f"routable {after_s:.1f} s after its start, served {served} of the next {sent}",
        errors == 0 and back and served >= 1,
    )


async def _index_stats(ctx: Context) -> dict[str, Any]:
    stats = (await admin_status(ctx.session, ctx.stack)).get("policy", {}).get("stats") or {}
    index: dict[str, Any] = (stats.get("index") or {}).get("main") or {}
    return index


async def _prefix_flood(ctx: Context) -> Observation:
    n = ctx.sizes.flood_requests
    gate = asyncio.Semaphore(16)
    before = await _index_stats(ctx)

    async def one(i: int) -> int:
        async with gate:
            body = chat_body(text(f"{ctx.run_id}/flood/{i}", FLOOD_PROMPT_CHARS), 1)
            return (await post(ctx.session, ctx.url(CHAT), KEY_B, body, timeout_s=60)).status

    async with RssPeak(ctx.stack.gateway_pid) as rss:
        statuses = await asyncio.gather(*(one(i) for i in range(n)))
    after = await _index_stats(ctx)
    entries, evictions = int(after.get("entries", -1)), int(after.get("evictions", 0))
    by_ns = after.get("keys_by_namespace") or {}
    biggest = max(by_ns.values(), default=0)
    offered = n * (FLOOD_PROMPT_CHARS // 4 // 16)  # approximate mode: 4 characters a token, 16 a block
    errors = sum(s != 200 for s in statuses)
    ok = (
        0 <= entries <= INDEX_MAX_ENTRIES
        and biggest <= NAMESPACE_SHARE * INDEX_MAX_ENTRIES
        and evictions > int(before.get("evictions", 0))
        and errors == 0
    )
    return Observation(
        f"~{offered} block holdings offered by {n} prompts: index {entries}/{INDEX_MAX_ENTRIES} holdings, "
        f"largest namespace {biggest} keys, {evictions} evictions; RSS +{mib(rss.growth)}; {errors} errors",
        ok,
    )


async def _cross_tenant(ctx: Context) -> Observation:
    # On the one-worker pool every request of B runs where A's KV is: only the tenants' salts keep
    # B from reusing it. Each prompt goes to B once (B's own repeat would rightly hit B's cache).
    b_cached: list[int] = []
    b_statuses: list[int] = []
    a_hits = 0
    n = ctx.sizes.cross_tenant_prompts
    for i in range(n):
        prompt = text(f"{ctx.run_id}/secret/{i}", CROSS_PROMPT_CHARS)
        for _ in range(2):
            a = await post(ctx.session, ctx.url(CHAT), KEY_A, chat_body(prompt, 4, model=SOLO_MODEL))
        a_hits += a.cached_tokens > 0
        body = {**chat_body(prompt, 4, model=SOLO_MODEL), **CROSS_VARIANTS[i % len(CROSS_VARIANTS)]}
        b = await post(ctx.session, ctx.url(CHAT), KEY_B, body)
        b_cached.append(b.cached_tokens)
        b_statuses.append(b.status)
    ok = all(c == 0 for c in b_cached) and all(s == 200 for s in b_statuses) and a_hits == n
    return Observation(
        f"A's repeats hit the cache {a_hits}/{n}; B sent the same {n} prompts to that worker "
        f"(plain, own cache_salt, prompt_cache_key, user): cached_tokens total {sum(b_cached)}, "
        f"status {sorted(set(b_statuses))}",
        ok,
    )


PROBES = (
    Probe(
        "kill_worker",
        lambda s: (
            f"kill -9 of a worker under {s.load_streams} streams: none hangs, errors ≤ its "
            "in-flight; routed again after restart"
        ),
        _kill_worker,
        lambda s: 180,
    ),
    Probe(
        "stop_worker",
        lambda s: (
            f"SIGSTOP of a worker for {STOP_HOLD_S:.0f} s under streams: none hangs, read "
            "timeouts retried, errors ≤ its in-flight; back after SIGCONT"
        ),
        _stop_worker,
        lambda s: 180,
    ),
    Probe(
        "restart_worker",
        lambda s: "graceful restart of a worker under load: 0 errors, routed again",
        _restart_worker,
        lambda s: 120,
    ),
    Probe(
        "prefix_flood",
        lambda s: (
            f"{s.flood_requests} unique long prompts: index ≤ its capacity ({INDEX_MAX_ENTRIES}), evicting"
        ),
        _prefix_flood,
        lambda s: 60 + s.flood_requests * 0.5,
    ),
    Probe(
        "cross_tenant",
        lambda s: (
            f"tenant B sends A's {s.cross_tenant_prompts} long prompts to the worker holding "
            "them: cached_tokens stay 0"
        ),
        _cross_tenant,
        lambda s: 120,
    ),
)
