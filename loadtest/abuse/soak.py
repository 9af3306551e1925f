"""A bounded soak: measure capacity briefly, then run at a share of it and watch for drift.

Capacity, kept simple: open-loop Poisson arrivals of one request shape (tenant B, non-streamed
chat, a shared 1,000-character system prompt and a unique 200-character question, 16 tokens out)
at 4 requests/s, doubling each step (`capacity_step_s` long) until a step fails, then one step
halfway between the last rate that passed and the first that failed. A step passes when every
request got 200, the arrivals were all sent (at most `MAX_OUTSTANDING` open at once, else the
gateway is not keeping up) and its p99 latency is at most twice the first step's (the unloaded
tail: queueing has not set in). The capacity is the highest rate that passed.

The soak then sends at `load_fraction` × capacity for the given minutes, and every
`soak_sample_s` records the requests completed, the errors, p50/p99 latency and the gateway's
RSS. It reports RSS growth (last sample against the first), the error count, and p99 drift (the
last sample's p99 over the first's), with the machine's load average before and after: on a
machine busy with other work the figures say as much about the neighbours as about the gateway.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from loadtest.abuse.client import CHAT, chat_body, post, text
from loadtest.abuse.observe import rss_bytes
from loadtest.abuse.probe import Context
from loadtest.abuse.stack import KEY_B

FIRST_RATE_RPS = 4.0
MAX_RATE_RPS = 1024.0
MAX_OUTSTANDING = 256
P99_GROWTH = 2.0
SYSTEM_CHARS, QUESTION_CHARS, OUTPUT_TOKENS = 1000, 200, 16


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Window:
    """Outcomes of the requests that ended within one step or sample."""

    latencies_s: list[float] = field(default_factory=list)
    errors_by_status: dict[int, int] = field(default_factory=dict)  # 0: a transport failure
    backlog_drops: int = 0

    @property
    def errors(self) -> int:
        return sum(self.errors_by_status.values())

    def add(self, status: int | None, latency_s: float) -> None:
        if status == 200:
            self.latencies_s.append(latency_s)
        elif status is None:
            self.backlog_drops += 1
        else:
            self.errors_by_status[status] = self.errors_by_status.get(status, 0) + 1


@dataclass(frozen=True, slots=True)
class Step:
    rate_rps: float
    completed: int
    errors_by_status: dict[int, int]
    backlog_drops: int
    p50_s: float
    p99_s: float
    passed: bool


@dataclass(frozen=True, slots=True)
class Sample:
    minute: float  # end of the sample, from the soak's start
    completed: int
    errors_by_status: dict[int, int]
    backlog_drops: int
    p50_s: float
    p99_s: float
    rss_bytes: int


@dataclass
class SoakReport:
    capacity_rps: float
    steps: list[Step]
    rate_rps: float
    minutes: float
    samples: list[Sample]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]

    @property
    def errors(self) -> int:
        return sum(sum(s.errors_by_status.values()) + s.backlog_drops for s in self.samples)

    @property
    def rss_growth(self) -> int:
        return self.samples[-1].rss_bytes - self.samples[0].rss_bytes if self.samples else 0

    @property
    def p99_drift(self) -> float:
        return self.samples[-1].p99_s / self.samples[0].p99_s if self.samples else float("nan")

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(errors=self.errors, rss_growth_bytes=self.rss_growth, p99_drift=round(self.p99_drift, 3))
        return out


class _Sender:
    """Open-loop Poisson arrivals; every outcome goes to the window `sink()` names at its end."""

    def __init__(self, ctx: Context, seed: int) -> None:
        self.ctx = ctx
        self.rng = random.Random(seed)
        self.sent = 0
        self.system = text("soak/system", SYSTEM_CHARS)

    async def _one(self, sink: Callable[[], Window]) -> None:
        content = self.system + "\n" + text(f"{self.ctx.run_id}/soak/{self.sent}", QUESTION_CHARS)
        self.sent += 1
        started = time.monotonic()
        reply = await post(self.ctx.session, self.ctx.url(CHAT), KEY_B, chat_body(content, OUTPUT_TOKENS))
        sink().add(reply.status, time.monotonic() - started)

    async def run(self, rate_rps: float, duration_s: float, sink: Callable[[], Window]) -> None:
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        at = 0.0
        while True:
            at += self.rng.expovariate(rate_rps)
            if at > duration_s:
                break
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= MAX_OUTSTANDING:
                sink().add(None, 0.0)
                continue
            task = asyncio.create_task(self._one(sink))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


async def _step(sender: _Sender, rate_rps: float, duration_s: float, first_p99_s: float | None) -> Step:
    window = Window()
    await sender.run(rate_rps, duration_s, lambda: window)
    p99 = quantile(window.latencies_s, 0.99)
    passed = window.errors == 0 and window.backlog_drops == 0
    passed = passed and (first_p99_s is None or p99 <= P99_GROWTH * first_p99_s)
    return Step(
        rate_rps,
        len(window.latencies_s),
        window.errors_by_status,
        window.backlog_drops,
        quantile(window.latencies_s, 0.5),
        p99,
        passed,
    )


async def measure_capacity(ctx: Context, sender: _Sender) -> tuple[float, list[Step]]:
    steps: list[Step] = []
    rate, first_p99 = FIRST_RATE_RPS, None
    while rate <= MAX_RATE_RPS:
        step = await _step(sender, rate, ctx.sizes.capacity_step_s, first_p99)
        steps.append(step)
        first_p99 = first_p99 if first_p99 is not None else step.p99_s
        if not step.passed:
            break
        rate *= 2
    passed = [s.rate_rps for s in steps if s.passed]
    if steps[-1].passed or not passed:
        return (max(passed) if passed else 0.0), steps
    middle = await _step(sender, (passed[-1] + steps[-1].rate_rps) / 2, ctx.sizes.capacity_step_s, first_p99)
    steps.append(middle)
    return max(s.rate_rps for s in steps if s.passed), steps


async def soak(ctx: Context, minutes: float, load_fraction: float, seed: int) -> SoakReport:
    load_before = os.getloadavg()
    sender = _Sender(ctx, seed)
    capacity, steps = await measure_capacity(ctx, sender)
    rate = max(capacity * load_fraction, 1.0)
    windows = [Window()]
    samples: list[Sample] = []
    started = time.monotonic()

    async def sample_every() -> None:
        while True:
            await asyncio.sleep(ctx.sizes.soak_sample_s)
            window = windows[-1]
            windows.append(Window())
            samples.append(
                Sample(
                    round((time.monotonic() - started) / 60, 2),
                    len(window.latencies_s),
                    window.errors_by_status,
                    window.backlog_drops,
                    quantile(window.latencies_s, 0.5),
                    quantile(window.latencies_s, 0.99),
                    rss_bytes(ctx.stack.gateway_pid),
                )
            )

    sampler = asyncio.create_task(sample_every())
    try:
        await sender.run(rate, minutes * 60, lambda: windows[-1])
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return SoakReport(capacity, steps, rate, minutes, samples, load_before, os.getloadavg())


def _errors(by_status: dict[int, int]) -> str:
    """`0`, or the count and its statuses: `35 (503×35)`; status 0 is a transport failure."""
    total = sum(by_status.values())
    if not total:
        return "0"
    return f"{total} ({', '.join(f'{k}×{v}' for k, v in sorted(by_status.items()))})"


def soak_text(report: SoakReport) -> str:
    """The soak's figures as Markdown."""
    lines = [
        "Capacity steps (open-loop Poisson arrivals; dropped: arrivals past the client's bound of "
        f"{MAX_OUTSTANDING} open requests):",
        "",
        "| rate req/s | completed | errors | dropped | p50 ms | p99 ms | passed |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in report.steps:
        lines.append(
            f"| {s.rate_rps:.0f} | {s.completed} | {_errors(s.errors_by_status)} | {s.backlog_drops} "
            f"| {s.p50_s * 1000:.0f} "
            f"| {s.p99_s * 1000:.0f} | {'yes' if s.passed else 'no'} |"
        )
    lines += [
        "",
        f"capacity {report.capacity_rps:.0f} req/s; soak at {report.rate_rps:.1f} req/s for "
        f"{report.minutes:g} min",
        "",
        "| minute | completed | errors | dropped | p50 ms | p99 ms | RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in report.samples:
        lines.append(
            f"| {m.minute:g} | {m.completed} | {_errors(m.errors_by_status)} | {m.backlog_drops} "
            f"| {m.p50_s * 1000:.0f} | {m.p99_s * 1000:.0f} "
            f"| {m.rss_bytes / 2**20:.0f} |"
        )
    lines += [
        "",
        f"RSS growth {report.rss_growth / 2**20:+.1f} MB, errors {report.errors}, p99 drift "
        f"×{report.p99_drift:.2f} (last sample against the first); load average "
        f"{' '.join(f'{x:.2f}' for x in report.load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in report.load_after)} after",
    ]
    return "\n".join(lines)
