from __future__ import annotations

import asyncio

import pytest

from gateway.upstream_slots import ConnectionSlots


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
