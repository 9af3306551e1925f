"""Per-worker load over time, sampled from each worker's Prometheus `/metrics` (vLLM names)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

_LINE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)
WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
)


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The unlabelled-or-summed values of the vLLM metrics in `WANTED` (labels are summed over)."""
    out: dict[str, float] = {}
    for name, value in _LINE.findall(text):
        if name in WANTED and value != "NaN":
            out[name] = out.get(name, 0.0) + float(value)
    return out


@dataclass(frozen=True, slots=True)
class LoadSample:
    t_s: float
    worker: int
    running: int
    waiting: int


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    try:
        async with session.get(url + "/metrics") as resp:
            if resp.status != 200:
                return None
            return parse_vllm_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError):
        return None


async def sample_load(
    urls: Sequence[str],
    interval_s: float,
    stop: asyncio.Event,
    out: list[LoadSample],
    max_samples: int = 100_000,
) -> None:
    """Append one sample per worker every `interval_s` until `stop` is set (bounded by `max_samples`)."""
    timeout = aiohttp.ClientTimeout(total=max(interval_s, 1.0))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()
        while not stop.is_set() and len(out) < max_samples:
            scraped = await asyncio.gather(*(scrape(session, u) for u in urls))
            now = time.monotonic() - t0
            for i, m in enumerate(scraped):
                if m is not None:
                    running = int(m.get("vllm:num_requests_running", 0))
                    waiting = int(m.get("vllm:num_requests_waiting", 0))
                    out.append(LoadSample(now, i, running, waiting))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
