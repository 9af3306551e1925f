"""Outcomes recorded as they happened: streams that reached `[DONE]` are successes, tpm charges
what the worker counted, a worker that answers garbage or nothing at all is counted against and
worked around."""

from __future__ import annotations

import asyncio
import statistics

from loadtest.abuse.client import CHAT, chat_body, post, stream, text
from loadtest.abuse.observe import metrics, routable, series, wait_for
from loadtest.abuse.probe import Context, Observation, Probe
from loadtest.abuse.report import counts
from loadtest.abuse.stack import GARBAGE_MODEL, HUNG_MODEL, KEY_B, KEY_METERED, TPM

TPM_OVERSHOOT = 1.5  # the quota plus the one request admitted before its count came back
TPM_MAX_REQUESTS = 40
HUNG_REQUESTS = 12


async def _faulty_received(ctx: Context, mode: str) -> int:
    async with ctx.session.get(ctx.stack.faulty_url(mode) + "/_stats") as resp:
        return int((await resp.json())["requests"])


async def _streams_done(ctx: Context) -> Observation:
    n, c = ctx.sizes.done_streams, ctx.sizes.done_concurrency
    ids = [ctx.rid("done", i) for i in range(n)]
    gate = asyncio.Semaphore(c)

    async def one(i: int) -> bool:
        async with gate:
            body = chat_body(text(f"{ctx.run_id}/done/{i}", 64), ctx.sizes.stream_tokens, stream=True)
            reply = await stream(ctx.session, ctx.url(CHAT), KEY_B, body, request_id=ids[i], timeout_s=60)
            durations.append(reply.elapsed_s)
            return reply.complete

    durations: list[float] = []
    complete = sum(await asyncio.gather(*(one(i) for i in range(n))))
    lines = await ctx.log.wait_requests(set(ids), timeout_s=15)
    statuses = [line["status"] for line in lines.values()]
    n499 = statuses.count(499)
    ok = complete == n and len(lines) == n and all(s == 200 for s in statuses)
    return Observation(
        f"{complete}/{n} read to [DONE] (mean {statistics.mean(durations):.2f} s); {len(lines)} access "
        f"lines: status {counts(statuses)}; {n499} with 499",
        ok,
    )


async def _tpm(ctx: Context) -> Observation:
    # The emulator counts a token per byte of the rendered prompt, four times the gateway's
    # estimate of a character per four: only reconciliation keeps the tenant near its quota.
    used = admitted = 0
    refused = None
    for i in range(TPM_MAX_REQUESTS):
        body = chat_body(text(f"{ctx.run_id}/tpm/{i}", 800), 8)
        reply = await post(ctx.session, ctx.url(CHAT), KEY_METERED, body)
        if reply.status != 200:
            refused = reply
            break
        admitted += 1
        usage = (reply.body or {}).get("usage") or {}
        used += int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
    if refused is None:
        return Observation(f"never refused in {TPM_MAX_REQUESTS} requests ({used} tokens)", False)
    ratio = used / TPM
    return Observation(
        f"{admitted} admitted, {used} tokens = {ratio:.2f}× the quota of {TPM}; then "
        f"{refused.status} {refused.error_code}",
        refused.status == 429 and 0 < ratio <= TPM_OVERSHOOT,
    )


async def _garbage_worker(ctx: Context) -> Observation:
    url = ctx.stack.faulty_url("garbage")
    await wait_for(lambda: routable(ctx.session, ctx.stack, "garbage", url), 15)
    before = await _faulty_received(ctx, "garbage")
    replies = []
    for i in range(4):
        body = chat_body("x", 4, stream=i % 2 == 1, model=GARBAGE_MODEL)
        replies.append(await post(ctx.session, ctx.url(CHAT), KEY_B, body))
    drew = await _faulty_received(ctx, "garbage") - before
    still = await routable(ctx.session, ctx.stack, "garbage", url)
    seen = [f"{r.status} {r.error_code}" for r in replies]
    ok = seen[:2] == ["502 bad_gateway"] * 2 and not still and drew == 2
    return Observation(
        f"{', '.join(seen)}; it drew {drew}, then its breaker opened (routable: {still})",
        ok,
    )


async def _read_timeout(ctx: Context) -> Observation:
    hang = ctx.stack.faulty_url("hang")

    async def both_routable() -> bool:
        ok_url = ctx.stack.faulty_url("ok")
        return all([await routable(ctx.session, ctx.stack, "hung", u) for u in (hang, ok_url)])

    await wait_for(both_routable, 15)
    before = series(await metrics(ctx.session, ctx.stack), "kvgate_upstream_retries_total", pool="hung")
    drew_before = await _faulty_received(ctx, "hang")
    answered = 0
    for i in range(HUNG_REQUESTS):
        body = chat_body(text(f"{ctx.run_id}/hung/{i}", 100), 4, stream=i % 2 == 1, model=HUNG_MODEL)
        if i % 2:
            answered += (await stream(ctx.session, ctx.url(CHAT), KEY_B, body, timeout_s=20)).complete
        else:
            answered += (await post(ctx.session, ctx.url(CHAT), KEY_B, body, timeout_s=20)).status == 200
    samples = await metrics(ctx.session, ctx.stack)
    retries = series(samples, "kvgate_upstream_retries_total", pool="hung", reason="read_timeout")
    all_retries = series(samples, "kvgate_upstream_retries_total", pool="hung") - before
    drew = await _faulty_received(ctx, "hang") - drew_before
    ok = answered == HUNG_REQUESTS and retries >= 1 and drew <= 2
    return Observation(
        f"{answered}/{HUNG_REQUESTS} answered; read_timeout retries {retries:.0f} (all retries +"
        f"{all_retries:.0f}); the hung worker drew {drew} (breaker threshold 2)",
        ok,
    )


PROBES = (
    Probe(
        "streams_done",
        lambda s: (
            f"{s.done_streams} streams of ~{s.stream_tokens} tokens at concurrency "
            f"{s.done_concurrency} read to [DONE]: 0 access lines with 499"
        ),
        _streams_done,
        lambda s: 60 + s.done_streams * 1.5 / s.done_concurrency * 4,
    ),
    Probe(
        "tpm",
        lambda s: f"tpm {TPM}: requests past the quota refused (429); admitted ≤ {TPM_OVERSHOOT}× quota",
        _tpm,
        lambda s: 60,
    ),
    Probe(
        "garbage_worker",
        lambda s: "worker answering 200 + non-JSON: 502, counted against it (breaker opens at 2)",
        _garbage_worker,
        lambda s: 40,
    ),
    Probe(
        "read_timeout",
        lambda s: (
            f"hung worker (read timeout before first byte): all {HUNG_REQUESTS} answered by "
            "retry on another worker, counted"
        ),
        _read_timeout,
        lambda s: 60,
    ),
)
