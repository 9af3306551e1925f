"""What a probe is: a name, what it expects, a bounded run against the stack, and its time limit.

A probe returns an `Observation`; `run_probe` turns it into a `Verdict`, and a probe that
overruns its limit or raises is a failed verdict that says so, never a hung suite.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from loadtest.abuse.observe import AccessLog
from loadtest.abuse.report import Verdict
from loadtest.abuse.settings import Sizes
from loadtest.abuse.stack import Stack


@dataclass(frozen=True, slots=True)
class Observation:
    observed: str
    ok: bool


@dataclass
class Context:
    """Everything a probe may touch."""

    stack: Stack
    sizes: Sizes
    session: aiohttp.ClientSession
    log: AccessLog
    run_id: str  # prefix of every request id this run sends, so log lines are found by name

    def url(self, path: str) -> str:
        return self.stack.base_url + path

    def rid(self, *parts: object) -> str:
        return "-".join([self.run_id, *map(str, parts)])


@dataclass(frozen=True, slots=True)
class Probe:
    name: str
    expected: Callable[[Sizes], str]
    run: Callable[[Context], Awaitable[Observation]]
    limit_s: Callable[[Sizes], float]


async def run_probe(probe: Probe, ctx: Context) -> Verdict:
    expected = probe.expected(ctx.sizes)
    limit_s = probe.limit_s(ctx.sizes)
    started = time.monotonic()
    try:
        seen = await asyncio.wait_for(probe.run(ctx), limit_s)
    except TimeoutError:
        seen = Observation(f"did not finish within its limit of {limit_s:.0f} s", False)
    except Exception as exc:  # a probe's own failure is its verdict, the suite goes on
        where = traceback.format_exception(exc)[-1].strip()
        seen = Observation(f"probe error: {where}", False)
    return Verdict(probe.name, expected, seen.observed, seen.ok, time.monotonic() - started)
