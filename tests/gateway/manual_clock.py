"""A clock for the lean upstream client's timeouts that moves only when the test says.

The pool's deadlines are set and checked on its sweep's clock (`upstream_slots.TimeoutSweep`).
With this one, a request never times out because the machine was slow, and a test that wants a
timeout moves the clock past the deadline (`advance`), which sweeps at once: no waiting on real
time either way. A pool takes it as `UpstreamPool(sweep=clock.sweep)`.
"""

from __future__ import annotations

from gateway.upstream_slots import TimeoutSweep


class ManualClock:
    """Seconds that pass only through `advance`; `sweep` checks its deadlines on them."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s
        self.sweep = TimeoutSweep(clock=self)

    def time(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass and fail at once every request whose deadline they passed."""
        self.now_s += seconds
        self.sweep.check()
