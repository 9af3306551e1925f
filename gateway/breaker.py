"""A per-worker circuit breaker fed by request outcomes (passive health).

closed → (failure_threshold consecutive failures) → open → (cooldown_s) → half-open: one trial
request; success closes, failure re-opens for another cooldown.

A failure that no other worker's answer compared (a lone 5xx, the worker's own error event in a
stream: `outcome.HeldVerdicts`) is no verdict, but it leaves the worker suspected (`suspect`):
the gateway's own canary request then decides (`gateway/canary.py`, `on_canary`).

Failed canaries decide on their own: `failure_threshold` of them in a row open the breaker
whatever request successes come between them, and only a passed canary ends the row. A request's
success says nothing of generation when its route needs no engine (`/tokenize`, `/detokenize`),
so a worker failing every generation while it answers those would otherwise never be shut out.
"""

from __future__ import annotations

import enum
import math

from gateway.config.pool import BreakerConfig


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Invariants: `_trial_in_flight` is True only in HALF_OPEN; `_canary_failures` counts the
    failed canaries since the last passed one, and while it is not zero the worker is suspected
    again after each canary (the row goes on, one canary an interval, until a verdict)."""

    __slots__ = (
        "_canary_at_s",
        "_canary_failures",
        "_config",
        "_failures",
        "_opened_at_s",
        "_state",
        "_suspected",
        "_trial_in_flight",
    )

    def __init__(self, config: BreakerConfig) -> None:
        self._config = config
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at_s = 0.0
        self._trial_in_flight = False
        self._suspected = False  # a failure no other worker compared awaits a canary
        self._canary_at_s = -math.inf  # when the last canary was sent
        self._canary_failures = 0  # failed canaries in a row; no request's success resets it

    @property
    def failures(self) -> int:
        """Consecutive request failures so far (reset by a success)."""
        return self._failures

    @property
    def canary_failures(self) -> int:
        """Failed canaries in a row (reset by a passed canary only)."""
        return self._canary_failures

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
            self._open(now_s)

    def _open(self, now_s: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at_s = now_s
        self._trial_in_flight = False

    @property
    def suspected(self) -> bool:
        """Whether a failure no other worker compared awaits a canary (`suspect`)."""
        return self._suspected

    def suspect(self) -> None:
        """The worker failed a request with nothing to compare it with (a lone 5xx, its own error
        event in a stream): no verdict, since a client's input can cause that, but a canary is
        due (`canary_due`)."""
        self._suspected = True

    def canary_due(self, now_s: float) -> bool:
        """Whether the worker, suspected, may be sent a canary now: its breaker is not open (a
        half-open one may have one: its failure re-opens it) and the last canary was sent at
        least `canary.interval_s` ago. The caller also keeps one canary in flight at most."""
        if not self._suspected or self.state(now_s) is BreakerState.OPEN:
            return False
        return now_s - self._canary_at_s >= self._config.canary.interval_s

    def canary_sent(self, now_s: float) -> None:
        """A canary left: it answers for the suspicions so far; a later one makes a new one due."""
        self._suspected = False
        self._canary_at_s = now_s

    def on_canary(self, passed: bool | None, now_s: float) -> None:
        """A canary's verdict: failed (False) counts as a request failure and as one more failed
        canary in a row, unless the breaker was opened meanwhile (a verdict is not applied to a
        state it was not about); `failure_threshold` failed canaries in a row open the breaker
        whatever request successes came between them (module doc). A failed canary keeps the
        worker suspected, so that canaries go on, one every `canary.interval_s`, until one passes
        or the breaker opens (and again once it is half-open: a request's success may close it,
        and the next failed canary opens it again). Passed (True) ends the row and leaves the
        suspicion cleared, as `canary_sent` left it (only a request's success closes a half-open
        breaker, as before); None (a 4xx, a busy worker's 503, a timeout) decides nothing, and
        keeps the worker suspected only in a row of failed canaries, which it does not end."""
        if passed is True:
            self._canary_failures = 0
            return
        if passed is False and self.state(now_s) is not BreakerState.OPEN:
            self._canary_failures += 1
            self.on_failure(now_s)
            if self._canary_failures >= self._config.failure_threshold:
                self._open(now_s)
        if passed is False or self._canary_failures:
            self._suspected = True
