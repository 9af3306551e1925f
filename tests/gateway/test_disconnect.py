from __future__ import annotations

import asyncio
from typing import Any

from gateway.disconnect import DisconnectGuard, DisconnectWatch
from tests.support.wait import wait_until


def _receive_disconnect_after(delay_s: float, calls: list[float]) -> Any:
    async def receive() -> dict[str, Any]:
        calls.append(asyncio.get_running_loop().time())
        await asyncio.sleep(delay_s)
        return {"type": "http.disconnect"}

    return receive


async def test_a_request_still_waiting_is_cancelled_when_its_client_leaves() -> None:
    watch = DisconnectWatch(delay_s=0.05)
    calls: list[float] = []

    async def request() -> str:
        guard = DisconnectGuard(_receive_disconnect_after(0.05, calls), watch)
        try:
            await asyncio.sleep(5)  # waiting on a worker that never answers
            return "answered"
        except asyncio.CancelledError:
            assert guard.fired
            return "cancelled"
        finally:
            guard.close()

    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(request(), 2) == "cancelled"
    assert calls and calls[0] - started >= 0.05  # the watcher started only after the delay
    assert not watch._waiting and watch._timer is None  # nothing left behind


async def test_a_quick_request_starts_no_watcher() -> None:
    watch = DisconnectWatch(delay_s=0.05)
    calls: list[float] = []
    for _ in range(100):
        guard = DisconnectGuard(_receive_disconnect_after(0.0, calls), watch)
        await asyncio.sleep(0)
        guard.close()
        assert not guard.fired
    await wait_until(lambda: watch._timer is None)  # the last tick ran and found nobody waiting
    assert calls == [] and not watch._waiting
