"""A per-worker circuit breaker fed by request outcomes (passive health).

closed → (failure_threshold consecutive failures) → open → (cooldown_s) → half-open: one trial
request; success closes, failure re-opens for another cooldown.
"""

from __future__ import annotations

import enum

from gateway.config.pool import BreakerConfig


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Invariant: `_trial_in_flight` is True only in HALF_OPEN."""

    __slots__ = ("_config", "_failures", "_opened_at_s", "_state", "_trial_in_flight")

    def __init__(self, config: BreakerConfig) -> None:
        self._config = config
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at_s = 0.0
        self._trial_in_flight = False

    @property
    def failures(self) -> int:
        """Consecutive request failures so far (reset by a success)."""
        return self._failures

    @property
    def closed(self) -> bool:
        """Closed: requests pass whatever the time (the other states depend on it)."""
        return self._state is BreakerState.CLOSED

    def state(self, now_s: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now_s - self._opened_at_s >= self._config.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    def allows(self, now_s: float) -> bool:
        """Whether a new request may go to this worker now (does not reserve the trial)."""
        state = self.state(now_s)
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def on_dispatch(self, now_s: float) -> None:
        if self.state(now_s) is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def on_success(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial_in_flight = False

    def on_abandon(self) -> None:
        """The request ended without a verdict (the client left): free the trial slot only."""
        self._trial_in_flight = False

    def on_failure(self, now_s: float) -> None:
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self._config.failure_threshold:
            self._state = BreakerState.OPEN
            self._opened_at_s = now_s
            self._trial_in_flight = False
