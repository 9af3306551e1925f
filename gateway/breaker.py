"""A per-worker circuit breaker fed by request outcomes (passive health).

closed → (failure_threshold consecutive failures) → open → (cooldown_s) → half-open → trial:
success closes, failure re-opens for another cooldown. The cooldown runs from the moment the
breaker opened: an open breaker takes no verdict (below).

A failure that no other worker's answer compared (a lone 5xx, the worker's own error event in a
stream: `outcome.HeldVerdicts`) is no verdict, but it leaves the worker suspected (`suspect`):
the gateway's own canary request then decides (`gateway/canary.py`, `on_canary`).

Failed canaries decide on their own: `failure_threshold` of them in a row open the breaker
whatever request successes come between them, and only a passed canary ends the row. A request's
success says nothing of generation when its route needs no engine (`/tokenize`, `/detokenize`),
so a worker failing every generation while it answers those would otherwise never be shut out.
A canary's verdict judges only the spell it was sent in (`CanaryTicket`), as a held failure's
does: one sent while the breaker was closed, or in an earlier half-open spell, whose failure
arrived once it was half-open re-opened it before that spell's own canary was sent. Such a
failure neither opens the breaker nor counts; the worker stays suspected, so the spell's own
canary follows and decides.

The half-open trial. A client's request may fail for its own input (vLLM's 500 for one prompt),
and a tenant sending such requests as fast as it can wins the race for one trial request after
each cooldown: judged alone, its failure re-opened the breaker every time, and shut every other
tenant out of a worker that had recovered. So:

    entering half-open: the worker is suspected, so a canary is due (`canary_due`)
    a canary sent since: passed → closed; failed → open again;
        inconclusive (busy, 4xx, timeout) → client requests may be the trial (below)
    canaries have judged this worker before (`_canary_judges`: one passed or failed here):
        no client request is let through until that verdict, or `interval_s + timeout_s`
    otherwise (a P/D pool, canaries off, a chat-only pool answering them 404), and after an
        inconclusive canary, one client request at a time is the trial:
        success → closed; failure → the next request may be the trial;
        `failure_threshold` failed trials in a row (as many as open a closed breaker) → open;
        a trial's 5xx or read timeout before the first byte waits for the request's fate, as a
        closed breaker's does (`holds`, `on_held_failure`; `outcome.HeldVerdicts`): a failed
        trial if another worker serves the request or none was tried, none if another worker
        failed or refused it too (a tenant whose input every worker fails wins no trial)

The trial slot belongs to the request that took it (`on_dispatch` says so; `Worker.acquire`,
`outcome.Attempt` carry it to the verdict): a request sent before the breaker opened that ends
while it is half-open neither frees the slot (two client trials would run at once) nor judges
the breaker. A verdict that finds the breaker open is dropped too, as no request is sent to an
open worker: a success (`on_success`), since closing on it skipped the cooldown and the trial,
and a failure (`on_failure`), since restarting the cooldown on it kept a recovered worker out
for as long as requests sent before the breaker opened went on failing (to a hung worker, up to
their read timeout each), though they said nothing new.
"""

from __future__ import annotations

import enum
import math
from typing import NewType

from gateway.config.pool import BreakerConfig

# The half-open trial a request took (`CircuitBreaker.on_dispatch`): the breaker's spell it was
# taken in, so that a trial outliving its spell (a stream while a failed canary re-opened the
# breaker) neither frees nor judges a later spell's trial.
TrialTicket = NewType("TrialTicket", int)
# The breaker's spell a canary was sent in (`CircuitBreaker.canary_sent`), which its verdict
# carries back (`on_canary`): a canary sent while the breaker was closed, or in an earlier
# half-open spell, judges no later spell (its failure re-opened a half-open breaker it never saw).
CanaryTicket = NewType("CanaryTicket", int)


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Invariants: `_trial_in_flight` is True only in HALF_OPEN; `_canary_failures` counts the
    failed canaries since the last passed one, and while it is not zero the worker is suspected
    again after each canary (the row goes on, one canary an interval, until a verdict);
    `_trial_failures` counts the failed client trials since the breaker last became half-open,
    and is below `failure_threshold` while it is half-open; `_awaiting_canary` is False outside
    HALF_OPEN (module doc, "The half-open trial"); `_opened_at_s` is when the breaker last
    opened, and no verdict moves it while it is open (`_open` is entered from closed or
    half-open only)."""

    __slots__ = (
        "_awaiting_canary",
        "_canary_at_s",
        "_canary_failures",
        "_canary_judges",
        "_canary_spell",
        "_config",
        "_failures",
        "_opened_at_s",
        "_spell",
        "_state",
        "_suspected",
        "_trial_failures",
        "_trial_in_flight",
    )

    def __init__(self, config: BreakerConfig) -> None:
        self._config = config
        self._state = BreakerState.CLOSED
        self._spell = 0  # counts the changes of state: a held verdict is about one spell
        self._failures = 0
        self._opened_at_s = 0.0
        self._trial_in_flight = False
        self._trial_failures = 0  # failed client trials since the breaker became half-open
        self._awaiting_canary = False  # half-open: no client trial until the canary's verdict
        self._canary_judges = False  # a canary has passed or failed here: canaries reach it
        self._suspected = False  # a failure no other worker compared awaits a canary
        self._canary_at_s = -math.inf  # when the last canary was sent
        self._canary_spell = -1  # the spell the last canary was sent in (none yet)
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
        if self._state is BreakerState.OPEN and now_s >= self._half_open_at_s:
            self._state = BreakerState.HALF_OPEN
            self._spell += 1
            self._trial_in_flight = False
            self._trial_failures = 0
            # The trial is the gateway's own canary where canaries have reached this worker.
            self._suspected = True
            self._awaiting_canary = self._canary_judges
        return self._state

    @property
    def _half_open_at_s(self) -> float:
        return self._opened_at_s + self._config.cooldown_s

    def allows(self, now_s: float) -> bool:
        """Whether a new request may go to this worker now (does not reserve the trial)."""
        state = self.state(now_s)
        if state is BreakerState.CLOSED:
            return True
        if state is not BreakerState.HALF_OPEN or self._trial_in_flight:
            return False
        return not self._awaiting_canary or now_s >= self._half_open_at_s + self._canary_wait_s

    @property
    def _canary_wait_s(self) -> float:
        """How long a half-open breaker waits for its canary before a client request may be the
        trial: the longest a due canary waits for its interval and then runs (a canary that never
        comes, its worker down or the pool's canaries turned off, keeps nothing shut out)."""
        canary = self._config.canary
        return canary.interval_s + canary.timeout_s

    def on_dispatch(self, now_s: float) -> TrialTicket | None:
        """A request goes to the worker: half-open, it is the trial. The trial it took, if any,
        is returned, for its verdict (`on_success`, `on_failure`, `on_abandon`: `trial`)."""
        if self.state(now_s) is not BreakerState.HALF_OPEN or self._trial_in_flight:
            return None
        self._trial_in_flight = True
        return TrialTicket(self._spell)

    def _current(self, trial: TrialTicket | None) -> bool:
        """Whether `trial` is this half-open spell's trial (`_state` as last brought up to date)."""
        return trial is not None and self._state is BreakerState.HALF_OPEN and trial == self._spell

    def on_success(self, *, trial: TrialTicket | None) -> None:
        """A request's success closes the breaker, unless it finds it open, or half-open and it
        is not its trial (`trial`: the one its dispatch took): no other request is sent
        to such a worker, so it was dispatched before the breaker opened, and says nothing of
        what opened it (a worker may finish long answers while every new request fails on it)."""
        if self._state is BreakerState.CLOSED or self._current(trial):
            self._close()

    def _close(self) -> None:
        if self._state is not BreakerState.CLOSED:
            self._spell += 1
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial_in_flight = False
        self._awaiting_canary = False

    def on_abandon(self, *, trial: TrialTicket | None) -> None:
        """The request ended without a verdict (the client left): free the trial slot, if it was
        the request that took it (`trial`)."""
        if self._current(trial):
            self._trial_in_flight = False

    def on_failure(self, now_s: float, *, trial: TrialTicket | None) -> None:
        """A request's failure. Half-open, its trial's (`trial`: the one its dispatch took)
        counts as a closed breaker's does (module doc): the trial slot is freed for the next
        request, the worker is suspected (its canary may close the breaker), and
        `failure_threshold` failed trials in a row open it again. Another request's, and any
        that finds the breaker open, is dropped: dispatched before the breaker opened, it neither
        frees the trial nor judges it, nor restarts the cooldown (requests in flight to a hung
        worker fail one by one for up to their read timeout, and said nothing new)."""
        state = self.state(now_s)
        if state is not BreakerState.CLOSED and not self._current(trial):
            return
        if state is BreakerState.HALF_OPEN:
            self._trial_in_flight = False
            self._trial_failed(now_s)
            return
        self._failures += 1
        if self._failures >= self._config.failure_threshold:
            self._open(now_s)

    def _trial_failed(self, now_s: float) -> None:
        self._failures += 1
        self._trial_failures += 1
        self._suspected = True
        if self._trial_failures >= self._config.failure_threshold:
            self._open(now_s)

    @property
    def spell(self) -> int:
        """Which spell of its state the breaker is in (it counts the changes of state): a held
        failure is judged later only in the spell it was held in (`on_held_failure`)."""
        return self._spell

    def holds(self, now_s: float, *, trial: TrialTicket | None) -> bool:
        """Whether a request's failure (a 5xx, a read timeout before the first byte: `Failure.held`)
        may wait for the request's fate (`outcome.HeldVerdicts`): a closed breaker's, and a
        half-open breaker's trial's, whose slot is freed at once for the next request (a trial
        does not stay in flight for another worker's whole answer)."""
        state = self.state(now_s)
        return state is BreakerState.CLOSED or self._current(trial)

    def on_held_failure(self, now_s: float, spell: int, *, compared: bool) -> None:
        """A held failure judged, held in `spell`. `compared`: another worker served the request,
        which shows it to be the worker's: a closed breaker counts it as any failure, a
        half-open one as a failed trial (its slot was freed when it was held). Not `compared`:
        it was the request's only attempt of its leg's part, and only a half-open breaker counts
        it, as a failed trial (`outcome.HeldVerdicts.acquit`). In any later spell it is dropped:
        a verdict is not applied to a state it was not about."""
        state = self.state(now_s)
        if spell != self._spell:
            return
        if state is BreakerState.HALF_OPEN:
            self._trial_failed(now_s)
        elif state is BreakerState.CLOSED and compared:
            self.on_failure(now_s, trial=None)

    def _open(self, now_s: float) -> None:
        # From closed or half-open only: no verdict reaches an open breaker, so its cooldown
        # runs from the moment it opened.
        self._spell += 1
        self._state = BreakerState.OPEN
        self._opened_at_s = now_s
        self._trial_in_flight = False
        self._awaiting_canary = False

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
        half-open one is, from its start: the canary is its trial) and the last canary was sent at
        least `canary.interval_s` ago. The caller also keeps one canary in flight at most."""
        if not self._suspected or self.state(now_s) is BreakerState.OPEN:
            return False
        return now_s - self._canary_at_s >= self._config.canary.interval_s

    def canary_sent(self, now_s: float) -> CanaryTicket:
        """A canary left: it answers for the suspicions so far; a later one makes a new one due.
        Returns the spell it was sent in, for its verdict (`on_canary`: `sent`)."""
        self.state(now_s)  # a breaker half-open from now: the canary is its trial
        self._suspected = False
        self._canary_at_s = now_s
        self._canary_spell = self._spell
        return CanaryTicket(self._spell)

    def on_canary(self, passed: bool | None, now_s: float, *, sent: CanaryTicket | None = None) -> None:
        """A canary's verdict, `sent`: the ticket `canary_sent` gave it (by default the last
        canary sent's: the caller keeps one in flight at most). Failed (False) counts as a
        request failure and as one more failed canary in a row, unless the breaker changed state
        since it was sent (opened, or half-open since: a verdict is not applied to a state it was
        not about); `failure_threshold` failed canaries in a row open the breaker whatever
        request successes came between them (module doc), and a half-open breaker opens again at
        the first of its own. A failed canary keeps the worker suspected, so that canaries go on,
        one every `canary.interval_s`, until one passes or the breaker opens (and again once it
        is half-open: a stale one's failure leaves the spell's own canary due). Passed (True)
        ends the row and leaves the suspicion cleared, as `canary_sent` left it, and closes a
        half-open breaker when it was sent in this half-open spell (its trial); None (a 4xx, a
        busy worker's 503, a timeout) decides nothing: a half-open breaker's trial is then a
        client's request, and the worker stays suspected only in a row of failed canaries,
        which it does not end."""
        state = self.state(now_s)
        spell = self._canary_spell if sent is None else sent
        current = spell == self._spell and state is not BreakerState.OPEN
        trial = current and state is BreakerState.HALF_OPEN
        if passed is not None:
            self._canary_judges = True
        if passed is True:
            self._canary_failures = 0
            if trial:
                self._close()
            return
        if passed is False and current:
            self._canary_failures += 1
            self._failures += 1
            if (
                state is BreakerState.HALF_OPEN
                or self._failures >= self._config.failure_threshold
                or self._canary_failures >= self._config.failure_threshold
            ):
                self._open(now_s)
        elif passed is None and trial:
            self._awaiting_canary = False
        if passed is False or self._canary_failures:
            self._suspected = True
