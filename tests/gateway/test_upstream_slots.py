from __future__ import annotations

import asyncio

import pytest

from gateway.upstream_slots import ConnectionSlots, TimeoutSweep
from tests.gateway.manual_clock import ManualClock
from tests.support.wait import wait_until


async def test_slots_pass_in_order_and_a_cancelled_waiter_loses_nothing() -> None:
    slots = ConnectionSlots(1)
    assert slots.take() and not slots.take()
    first = asyncio.create_task(slots.wait(5))
    second = asyncio.create_task(slots.wait(5))
    await asyncio.sleep(0)
    # The first waiter's task is cancelled, and a slot comes back before that task runs again:
    # the slot must skip the cancelled waiter and go to the second one.
    first.cancel()
    slots.give()
    await asyncio.wait_for(second, 1)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert slots.free == 0 and not slots.waiters
    slots.give()
    assert slots.free == 1 and slots.take()


async def test_a_slot_handed_over_as_the_waiter_times_out_is_passed_on() -> None:
    slots = ConnectionSlots(1)
    assert slots.take()
    with pytest.raises(TimeoutError):
        await slots.wait(0.05)
    assert not slots.waiters and slots.free == 0
    late = asyncio.create_task(slots.wait(5))
    await asyncio.sleep(0)
    late.cancel()  # cancelled while still queued, before the slot comes back
    slots.give()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert slots.free == 1 and not slots.waiters  # nobody waiting: the slot is free again
    assert slots.take()


class Deadline:
    """An item of a sweep that expires at `at_s`, noting the times it was checked at."""

    def __init__(self, sweep: TimeoutSweep, at_s: float) -> None:
        self.sweep = sweep
        self.at_s = at_s
        self.checked: list[float] = []
        self.expired = False

    def check_timeout(self, now: float) -> None:
        self.checked.append(now)
        if now >= self.at_s:
            self.expired = True
            self.sweep.discard(self)


async def test_the_sweep_checks_on_the_loops_clock_and_stops_when_nothing_is_left() -> None:
    sweep = TimeoutSweep(tick_s=0.01)
    due = Deadline(sweep, asyncio.get_running_loop().time())
    sweep.add(due)
    await wait_until(lambda: due.expired)
    await wait_until(lambda: sweep._timer is None)  # the last tick saw nothing in flight


async def test_a_sweep_on_a_given_clock_fires_only_when_that_clock_passes_the_deadline() -> None:
    clock = ManualClock()
    due = Deadline(clock.sweep, clock.time() + 1.0)
    clock.sweep.add(due)
    await wait_until(lambda: len(due.checked) >= 2)  # the timer ticks on...
    assert set(due.checked) == {clock.time()} and not due.expired  # ... reading the given clock
    clock.advance(0.5)
    assert not due.expired
    clock.advance(0.5)
    assert due.expired
