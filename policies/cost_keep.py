"""Keeping a continuation on a holder predicted to answer in time (`cost`'s `stay_within_s`).

The score counts a worker's prefill backlog as whole prompts pending from dispatch to first token.
An agent's next turn often arrives while its previous turn is still in prefill on the session's
holder: that prompt, mostly cached and partly computed already, is counted whole, so the holder
looks seconds away (at 8.41× the agent trace's rate, seed 0: a median 3.4 s predicted where the
holder's backlog cleared a median 0.44 s later) and the turn recomputes its history elsewhere,
missing a TTFT objective it would have met by staying (docs/policy.md, step 8).

Counting every backlog that way ("discount_cached_backlog", "prefill_progress") keeps the sessions
but also keeps the turns that miss either way, and those pile up behind each other. So this rule
changes only the decisions where it matters to the objective: after scoring, when the chosen
worker's first token is predicted later than `over_s` and a holder of more than half the prompt,
within the load guard, is predicted within `within_s`, the request stays with that holder.

A `within_s` above `over_s` keeps, besides, turns that miss the objective wherever they go: the
move is predicted past it, and so is the holder, within `within_s`. The turn then waits on its
holder rather than recomputing its history elsewhere, which saves that prefill for everyone behind
it. Where clients wait for each answer (a closed loop) that raises the capacity; where turns keep
coming regardless (an open loop), the turns kept pile up behind each other (docs/benchmarks.md, "A
continuation kept where it is answered in time").

The prediction (`first_token_s`) is the holder's backlog at the uncached share the policy predicted
for the prompts pending there, its newest requests in flight (`InflightLedger.pending_share`), less
the time since the backlog restarted (`WorkerView.prefill_started_s`; before that the engine
computed none of it), plus the request's own prefill after its match there, all at the calibrated
scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from policies.base import WorkerId, WorkerView
from policies.cost_model import CostModel
from policies.records import record


@record
class Stay:
    """A holder the rule keeps: its candidate index, the tokens it holds (request tokens), its
    predicted first token in seconds and the wait for its backlog within it (the queue the
    decision records)."""

    index: int
    matched_tokens: int
    first_token_s: float
    wait_s: float


def wait_s(cost: CostModel, view: WorkerView, share: float, now_s: float) -> float:
    """Predicted seconds until `view`'s backlog is computed: counted at its predicted uncached
    `share`, drained since the backlog restarted."""
    pending = view.in_flight_prefill_tokens
    if pending <= 0:
        return 0.0
    p = cost.params
    unit = cost.engine_tokens_per_request_token
    left = share * pending * unit
    pairs = view.in_flight_prefill_pairs * unit * unit
    steps = -(-int(left) // p.max_batched_tokens)
    work = cost.scale * (p.prefill_s_per_token * left + p.attention_s_per_pair * pairs + p.step_s * steps)
    started = view.prefill_started_s
    elapsed = now_s - started if started is not None and now_s > started else 0.0
    return work - elapsed if work > elapsed else 0.0


def first_token_s(
    cost: CostModel, view: WorkerView, share: float, matched_tokens: int, prompt_tokens: int, now_s: float
) -> float:
    """Predicted seconds to a request's first token on `view` (token counts in request tokens):
    the wait for its backlog (`wait_s`) plus the request's own prefill after `matched_tokens`."""
    return wait_s(cost, view, share, now_s) + own_prefill_s(cost, matched_tokens, prompt_tokens)


def own_prefill_s(cost: CostModel, matched_tokens: int, prompt_tokens: int) -> float:
    """A request's own prefill after `matched_tokens` of it (request tokens) are cached."""
    unit = cost.engine_tokens_per_request_token
    matched = int(matched_tokens * unit)
    return cost.prefill_s(int(prompt_tokens * unit) - matched, matched)


def stay(
    cost: CostModel,
    views: Sequence[WorkerView],
    held: Sequence[tuple[int, int]],
    *,
    eligible: Callable[[int], bool],
    share: Callable[[WorkerId, int], float],
    chosen: tuple[int, int],
    prompt_tokens: int,
    limit_tokens: int,
    block_size_tokens: int,
    now_s: float,
    within_s: float,
    over_s: float,
) -> Stay | None:
    """The holder of more than half the prompt to keep instead of `chosen` (candidate index, tokens
    matched there), or None.

    `held`: (candidate index, blocks held) of every holder; `eligible`: whether a candidate may
    keep the request (`cost`: the load guard lets it in and its decode step, the request joining,
    stays within `stay_tpot_s`); `share`: the predicted uncached share of a worker's backlog of so many
    tokens. A holder is kept when `chosen` is predicted later than `over_s` and the holder within
    `within_s`; of several, the soonest.
    """
    index, matched = chosen
    view = views[index]
    pending = view.in_flight_prefill_tokens
    if first_token_s(cost, view, share(view.worker_id, pending), matched, prompt_tokens, now_s) <= over_s:
        return None
    best: Stay | None = None
    for i, blocks in held:
        m = blocks * block_size_tokens
        m = limit_tokens if limit_tokens < m else m
        if 2 * m <= prompt_tokens or i == index or not eligible(i):
            continue
        holder = views[i]
        wait = wait_s(cost, holder, share(holder.worker_id, holder.in_flight_prefill_tokens), now_s)
        t = wait + own_prefill_s(cost, m, prompt_tokens)
        if t <= within_s and (best is None or t < best.first_token_s):
            best = Stay(i, m, t, wait)
    return best
