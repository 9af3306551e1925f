"""SIGTERM drain: streams in flight complete, new requests are refused, the process exits 0.
It stops the gateway, so it always runs last."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp

from loadtest.abuse.client import CHAT, chat_body, new_session, stream, text
from loadtest.abuse.observe import metrics, series, wait_for
from loadtest.abuse.probe import Context, Observation, Probe
from loadtest.abuse.stack import KEY_B

DRAIN_TOKENS = 300  # about two seconds a stream: well inside the drain deadline (30 s)
REFUSAL_WAIT_S = 10.0


async def _refused(url: str) -> str | None:
    """How a new request on a new connection is refused now (None: it was served)."""
    async with new_session() as fresh:
        try:
            async with fresh.post(
                url,
                data=b"{}",
                headers={"authorization": f"Bearer {KEY_B}"},
                timeout=aiohttp.ClientTimeout(2),
            ) as resp:
                return f"{resp.status}" if resp.status == 503 else None
        except aiohttp.ClientConnectorError:
            return "connection refused"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return type(exc).__name__


async def _drain(ctx: Context) -> Observation:
    n = ctx.sizes.drain_streams

    async def in_flight() -> bool:
        samples = await metrics(ctx.session, ctx.stack)
        return series(samples, "kvgate_worker_in_flight", pool="main") >= n

    bodies = [chat_body(text(f"{ctx.run_id}/drain/{i}", 200), DRAIN_TOKENS, stream=True) for i in range(n)]
    streams = asyncio.gather(*(stream(ctx.session, ctx.url(CHAT), KEY_B, b, timeout_s=40) for b in bodies))
    await wait_for(in_flight, 10)
    os.kill(ctx.stack.gateway_pid, signal.SIGTERM)
    signalled = time.monotonic()
    refusal = None
    while refusal is None and time.monotonic() - signalled < REFUSAL_WAIT_S:
        refusal = await _refused(ctx.url(CHAT))
        if refusal is None:
            await asyncio.sleep(0.1)
    refused_after_s = time.monotonic() - signalled
    replies = await streams
    code = await asyncio.to_thread(ctx.stack.gateway_exit_code, 40)
    exit_after_s = time.monotonic() - signalled
    complete = sum(r.complete for r in replies)
    return Observation(
        f"{complete}/{n} in-flight streams read to [DONE]; new request: {refusal or 'served'} "
        f"{refused_after_s:.1f} s after SIGTERM; exit {code} after {exit_after_s:.1f} s",
        complete == n and refusal is not None and code == 0,
    )


PROBES = (
    Probe(
        "drain",
        lambda s: (
            f"SIGTERM with {s.drain_streams} streams in flight: they complete, new requests refused, exit 0"
        ),
        _drain,
        lambda s: 90,
    ),
)
