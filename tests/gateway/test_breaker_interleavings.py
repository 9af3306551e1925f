"""The breaker under random interleavings of every verdict it takes (`gateway/breaker.py`):
request outcomes with any trial ticket (the current trial's, an earlier spell's, none), held
failures of any spell, suspicions, canaries sent when due and their verdicts arriving in any
order, and time passing. Whatever comes, an open breaker turns half-open `cooldown_s` after it
opened (no verdict on an open breaker moves that moment), and a canary's verdict from an earlier
spell changes nothing of the breaker's state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.breaker import BreakerState, CanaryTicket, CircuitBreaker, TrialTicket
from gateway.config.pool import BreakerConfig, CanaryConfig

COOLDOWN_S = 10.0
OPS = ("fail", "succeed", "abandon", "dispatch", "suspect", "canary", "verdict", "held")
# (what happens, seconds passed before it, which ticket or spell it names, which verdict)
STEP = st.tuples(
    st.sampled_from(OPS),
    st.sampled_from([0.0, 0.5, 1.0, 4.0, COOLDOWN_S + 1]),
    st.integers(0, 15),
    st.integers(0, 2),
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(STEP, min_size=10, max_size=80), st.integers(1, 3))
def test_no_verdict_moves_an_open_breakers_cooldown_nor_judges_a_later_spell(
    steps: list[tuple[str, float, int, int]], failure_threshold: int
) -> None:
    config = BreakerConfig(
        failure_threshold=failure_threshold, cooldown_s=COOLDOWN_S, canary=CanaryConfig(interval_s=1)
    )
    breaker = CircuitBreaker(config)
    now_s = 0.0
    opened_s: float | None = None  # when the breaker last opened, while it is open
    trials: list[TrialTicket | None] = [None]
    canaries: list[CanaryTicket] = []  # every canary sent, its verdict given or not
    spells = [breaker.spell]
    for op, passed_s, pick, verdict in steps:
        now_s += passed_s
        state = breaker.state(now_s)
        if opened_s is not None:
            assert (state is BreakerState.OPEN) == (now_s < opened_s + COOLDOWN_S)
        before, failed_canaries = _judged(breaker, now_s), breaker.canary_failures
        if op == "fail":
            breaker.on_failure(now_s, trial=trials[pick % len(trials)])
            if state is BreakerState.OPEN:
                assert _judged(breaker, now_s) == before
        elif op == "succeed":
            breaker.on_success(trial=trials[pick % len(trials)])
        elif op == "abandon":
            breaker.on_abandon(trial=trials[pick % len(trials)])
        elif op == "dispatch" and breaker.allows(now_s):
            trials.append(breaker.on_dispatch(now_s))
        elif op == "suspect":
            breaker.suspect()
        elif op == "canary":
            breaker.suspect()  # a lone 5xx: the canary is due, once its interval has passed
            if breaker.canary_due(now_s):
                canaries.append(breaker.canary_sent(now_s))
        elif op == "verdict" and canaries:
            sent = canaries[pick % len(canaries)]
            breaker.on_canary((True, False, None)[verdict], now_s, sent=sent)
            if sent != before[1]:  # an earlier spell's: not counted (a passed one still ends the row)
                assert _judged(breaker, now_s) == before and breaker.canary_failures <= failed_canaries
        elif op == "held":
            breaker.on_held_failure(now_s, spells[pick % len(spells)], compared=verdict == 1)
        after = breaker.state(now_s)
        if after is BreakerState.OPEN and state is not BreakerState.OPEN:
            opened_s = now_s
        elif after is not BreakerState.OPEN:
            opened_s = None
        if breaker.spell != spells[-1]:
            spells.append(breaker.spell)


def _judged(breaker: CircuitBreaker, now_s: float) -> tuple[BreakerState, int, int]:
    """What a verdict judges: the state, its spell, the failures counted."""
    return breaker.state(now_s), breaker.spell, breaker.failures
