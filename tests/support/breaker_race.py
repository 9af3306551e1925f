"""The half-open trial race measured for docs/reliability.md: `python -m tests.support.breaker_race
[SECONDS]` (a measurement, not a test: its clients keep their own pace).

One worker's bad spell opens its breaker (the defaults: 3 failures, 5 s cooldown, a canary every
2 s at most); then a tenant whose own input fails a healthy worker sends a request whenever the
breaker lets one through, and another tenant one every 0.25 s. It prints how often the breaker
opened again, when it closed, and what each tenant got."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from gateway.breaker import BreakerState
from tests.gateway.canary_rig import POISON, WAIT_S, gateway
from tests.support.wait import wait_until


async def race(run_s: float) -> str:
    """The race measured for docs/reliability.md, with the breaker's defaults (3 failures, 5 s
    cooldown, a canary every 2 s at most): one worker's bad spell opens its breaker; then, for
    `run_s`, the poison tenant sends a request whenever the breaker lets one through and another
    tenant one every 0.25 s."""
    async with gateway("a", retry_attempts=0) as rig:
        a = rig.worker("p", "a").breaker
        rig.workers.broken.add("a")
        await rig.chat()
        await wait_until(lambda: not a.closed, timeout_s=WAIT_S, what="a's breaker opened")
        rig.workers.broken.clear()
        started_s, stop = time.monotonic(), asyncio.Event()
        poisoned: Counter[int] = Counter()
        other: Counter[int] = Counter()
        opened, closed_after_s = 0, None

        async def poison() -> None:
            while not stop.is_set():
                await wait_until(
                    lambda: stop.is_set() or a.allows(time.monotonic()), timeout_s=run_s + WAIT_S
                )
                if not stop.is_set():
                    poisoned[(await rig.chat(POISON)).status_code] += 1

        async def tenant() -> None:
            while not stop.is_set():
                other[(await rig.chat(tenant="u")).status_code] += 1
                await asyncio.sleep(0.25)  # a steady client's pace, not a wait for a condition

        async def watch() -> None:
            nonlocal opened, closed_after_s
            last = BreakerState.OPEN
            while not stop.is_set():
                now_s = time.monotonic()
                state = a.state(now_s)
                opened += state is BreakerState.OPEN and last is not BreakerState.OPEN
                if state is BreakerState.CLOSED and closed_after_s is None:
                    closed_after_s = now_s - started_s
                last = state
                await asyncio.sleep(0.005)

        tasks = [asyncio.create_task(f()) for f in (poison, tenant, watch)]
        await asyncio.sleep(run_s)
        stop.set()
        await asyncio.gather(*tasks)
        closed = "never closed" if closed_after_s is None else f"closed after {closed_after_s:.2f} s"
        return (
            f"{run_s:g} s: re-opened {opened} times, {closed};"
            f" poison tenant {dict(poisoned)}, other tenant {dict(other)},"
            f" canaries {dict((str(k), v) for k, v in rig.canaries.counts.items())}"
        )


if __name__ == "__main__":
    import sys

    print(asyncio.run(race(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)))
