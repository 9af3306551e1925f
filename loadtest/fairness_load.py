"""Closed-loop tenants for the fairness benchmark: each client sends one streamed chat request,
waits for its end, and sends the next, until the phase ends.

Per request the client records its tenant, when it started, its time to the first token and to
the end, and the status; the gateway's own queue wait comes from its access log (`queue_ms`,
matched by the `x-request-id` the client sent). Prompts are unique per request (seeded), so no
request is faster for a cache hit, and answer lengths vary (seeded, uniform within ±50% of
`max_tokens`): with equal lengths, a closed loop keeps every slot of the pool freeing at the same
moment, and a request arriving just after such a moment waits a whole answer for the next.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from loadtest.workloads.text import synth_text


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as its client saw it (times in seconds from the phase's start)."""

    request_id: str
    tenant: str
    started_s: float
    ttft_s: float | None
    latency_s: float
    status: int


@dataclass(frozen=True, slots=True)
class Tenant:
    """`clients` closed loops sending with `api_key`."""

    name: str
    api_key: str
    clients: int


async def run_phase(
    base_url: str,
    model: str,
    tenants: Sequence[Tenant],
    *,
    phase: str,
    duration_s: float,
    max_tokens: int,
    prompt_chars: int,
    seed: int,
) -> list[Sample]:
    """Run every tenant's clients for `duration_s`; the samples of every request that ended."""
    samples: list[Sample] = []
    started = time.monotonic()
    end = started + duration_s
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def client(tenant: Tenant, n: int) -> None:
            i = 0
            rng = random.Random(f"{seed}/{phase}/{tenant.name}/{n}")
            while time.monotonic() < end:
                rid = f"{phase}-{tenant.name}-{n}-{i}"
                prompt = synth_text(f"{seed}/{rid}", prompt_chars)
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2),
                    "stream": True,
                }
                headers = {"authorization": f"Bearer {tenant.api_key}", "x-request-id": rid}
                samples.append(await _one(session, base_url, body, headers, rid, tenant.name, started))
                i += 1

        await asyncio.gather(*(client(t, n) for t in tenants for n in range(t.clients)))
    return samples


async def _one(
    session: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, object],
    headers: dict[str, str],
    rid: str,
    tenant: str,
    phase_start: float,
) -> Sample:
    t0 = time.monotonic()
    ttft: float | None = None
    async with session.post(
        base_url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
    ) as resp:
        status = resp.status
        async for chunk in resp.content.iter_any():
            if ttft is None and status == 200 and b'"content"' in chunk:
                ttft = time.monotonic() - t0
    return Sample(rid, tenant, t0 - phase_start, ttft, time.monotonic() - t0, status)


def queue_waits_ms(log_path: Path) -> dict[str, float]:
    """`queue_ms` by client request id, from the gateway's JSON access lines (0 for requests that
    found a worker at once)."""
    waits: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{") or '"queue_ms"' not in line:
            continue
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        rid = fields.get("client_request_id")
        if isinstance(rid, str):
            waits[rid] = float(fields.get("queue_ms") or 0.0)
    return waits


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (`q` in 0-100); NaN when there are no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
