"""`cost`'s stay rule (`policies.cost_keep`): a continuation stays with a holder predicted to answer
within `stay_within_s` when the worker the score chose is predicted past `stay_objective_s`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from policies.base import Observation, WorkerId, WorkerView
from policies.cost_keep import Stay, first_token_s, stay
from policies.cost_ledger import InflightLedger
from policies.cost_policy import CostPolicy
from tests.policies.factories import BS, req, workers

HISTORY = 2560  # blocks: 40,960 tokens, about 1.9 s to recompute on the default profile


def _session_on_w0(**kw: object) -> tuple[CostPolicy, list[WorkerView]]:
    """A policy whose w0 holds a session's history and is computing its previous turn: the turn is
    all but cached (its predicted uncached share is tiny), but the view counts 2M prompt tokens
    pending there (its sessions' turns, whole), so the score sees w0 seconds away and sends the
    next turn to an idle worker. Its decode step with 2M tokens of context is past the default
    `stay_tpot_s`, which the tests of the other bounds lift (`stay_tpot_s` 1 s)."""
    p = CostPolicy(seed=1, **{"stay_tpot_s": 1.0, **kw})  # type: ignore[arg-type]
    warm = req("warm", range(HISTORY))
    d = p.select(warm, [WorkerView(WorkerId("w0"))], 0.0)
    assert d is not None
    p.on_dispatch(warm, d, 0.0)
    p.on_complete(Observation(warm, d.worker, ttft_s=None, prompt_tokens=warm.n_prompt_tokens), 0.0)
    prev = req("prev", range(HISTORY + 1))
    d = p.select(prev, [WorkerView(WorkerId("w0"))], 1.0)
    assert d is not None and d.worker == "w0"
    p.on_dispatch(prev, d, 1.0)
    views = workers(1, 0, 0, 0, prefill=(2_000_000, 0, 0, 0))
    views[0] = dataclasses.replace(views[0], in_flight_prefill_pairs=1_000_000, prefill_started_s=1.0)
    return p, views


def test_a_turn_stays_with_a_holder_predicted_in_time_when_the_move_would_miss() -> None:
    p, views = _session_on_w0()
    d = p.select(req("next", range(HISTORY + 2)), views, 1.1)
    assert d is not None and d.worker == "w0" and d.reason == "hit"
    assert p.stats().counters["stays_within_objective"] == 1
    # The score recorded is the kept holder's at the rule's own wait (seconds saved less a short
    # wait), not at the whole-prompt queue that made the score move the turn (tens of seconds).
    assert d.score_s > 0
    p.check_invariants()


def test_without_the_rule_the_score_moves_the_turn() -> None:
    p, views = _session_on_w0(stay_objective_s=None)
    d = p.select(req("next", range(HISTORY + 2)), views, 1.1)
    assert d is not None and d.worker != "w0" and d.reason == "spread"
    assert "stays_within_objective" not in p.stats().counters


def test_a_holder_predicted_past_the_bound_or_the_guard_does_not_keep_the_turn() -> None:
    # Predicted within 0.7 s only with the tiny share: a bound of 0 keeps nothing.
    p, views = _session_on_w0(stay_within_s=0.0)
    d = p.select(req("next", range(HISTORY + 2)), views, 1.1)
    assert d is not None and d.worker != "w0"
    # A holder whose decode step, with the turn joining its batch, would pass `stay_tpot_s` keeps
    # nothing (its sessions' TPOT would pay for the turn's TTFT).
    p, views = _session_on_w0(stay_tpot_s=0.0)
    d = p.select(req("next", range(HISTORY + 2)), views, 1.1)
    assert d is not None and d.worker != "w0"
    # A move predicted within the objective (a generous one) is left alone.
    p, views = _session_on_w0(stay_objective_s=100.0)
    d = p.select(req("next", range(HISTORY + 2)), views, 1.1)
    assert d is not None and d.worker != "w0"
    # Past the load guard (10 in flight against a bound of 9.75), the guard's move stands.
    p, views = _session_on_w0()
    views[0] = dataclasses.replace(views[0], in_flight_requests=10)
    d = p.select(req("next", range(HISTORY + 2)), views, 1.1)
    assert d is not None and d.worker != "w0"
    # A guard exemption for a holder of most of the prompt lets it in here too.
    p, views = _session_on_w0(continuation_slack_requests=8.0)
    views[0] = dataclasses.replace(views[0], in_flight_requests=10)
    d = p.select(req("next", range(HISTORY + 2)), views, 1.1)
    assert d is not None and d.worker == "w0"
    with pytest.raises(ValueError, match="stay_objective_s"):
        CostPolicy(stay_objective_s=0.0)
    with pytest.raises(ValueError, match="stay_within_s"):
        CostPolicy(stay_within_s=-1.0)


def test_a_bound_past_the_objective_keeps_turns_that_miss_it_either_way() -> None:
    # The holder is predicted `t` s away and the move (recomputing 40,960 tokens) later still. With
    # an objective at a quarter of `t` both miss it: within a bound below `t` the move stands,
    # within one above it the turn waits on its holder.
    p, views = _session_on_w0()
    nxt = req("next", range(HISTORY + 2))
    share = p._ledger.pending_share(views[0].worker_id, views[0].in_flight_prefill_tokens)
    t = first_token_s(p._pool(nxt).cost, views[0], share, HISTORY * BS, nxt.n_prompt_tokens, 1.1)
    assert 0 < t < 0.7
    for within_s, kept in ((t / 2, False), (2 * t, True)):
        p, views = _session_on_w0(stay_objective_s=t / 4, stay_within_s=within_s)
        d = p.select(nxt, views, 1.1)
        assert d is not None and (d.worker == "w0") is kept
        assert p.stats().counters.get("stays_within_objective", 0) == int(kept)


def test_a_holder_computing_a_long_new_prompt_does_not_keep_the_turn() -> None:
    # w0 holds the session (40,960 tokens) and has in flight ten of its turns decoding, all but
    # cached, and a 120k-token prompt of another session, all new, still in prefill. Over
    # everything in flight the uncached share is about 0.2, and w0 would look quick; over the
    # prompts pending (the newest) it is 1, and the turn is not kept there.
    cost = CostPolicy(seed=1)._pool(req("r", range(4))).cost
    ledger = InflightLedger()
    w0 = WorkerId("w0")
    for k in range(10):
        ledger.add(f"turn{k}", w0, HISTORY * BS + 1, 1)
    ledger.add("other", w0, 120_000, 120_000)
    views = [
        WorkerView(w0, in_flight_requests=11, in_flight_prefill_tokens=120_000, prefill_started_s=1.0),
        WorkerView(WorkerId("w1")),
    ]
    n = (HISTORY + 2) * BS + 1

    def kept(share: Callable[[WorkerId, int], float]) -> Stay | None:
        return stay(
            cost,
            views,
            [(0, HISTORY)],
            eligible=lambda i: True,
            share=share,
            chosen=(1, 0),
            prompt_tokens=n,
            limit_tokens=n - 1,
            block_size_tokens=BS,
            now_s=1.1,
            within_s=0.7,
            over_s=1.4,
        )

    assert kept(ledger.pending_share) is None
    found = kept(lambda w, _: ledger.share(w))
    assert found is not None and found.index == 0 and found.first_token_s < 0.7


def test_first_token_counts_what_is_left_of_the_backlog_then_the_own_prefill() -> None:
    p = CostPolicy(seed=1)
    cost = p._pool(req("r", range(4))).cost
    view = WorkerView(WorkerId("w0"), in_flight_requests=1, in_flight_prefill_tokens=8192)
    own = cost.prefill_s(10 * BS, 0)
    whole = first_token_s(cost, view, 1.0, 0, 10 * BS, 5.0)
    backlog = cost.scale * (cost.params.prefill_s_per_token * 8192 + cost.params.step_s)
    assert whole == pytest.approx(own + backlog)  # nothing drained without a known start
    half = first_token_s(cost, view, 0.5, 0, 10 * BS, 5.0)
    assert own < half < whole
    started = dataclasses.replace(view, prefill_started_s=4.9)
    assert first_token_s(cost, started, 1.0, 0, 10 * BS, 5.0) == pytest.approx(whole - 0.1)
    done = dataclasses.replace(view, prefill_started_s=0.0)
    assert first_token_s(cost, done, 1.0, 0, 10 * BS, 5.0) == pytest.approx(own)
    assert first_token_s(cost, WorkerView(WorkerId("w1")), 1.0, 8 * BS, 10 * BS, 5.0) == pytest.approx(
        cost.prefill_s(2 * BS, 8 * BS)
    )


def test_the_pending_share_is_the_newest_prompts_that_make_up_the_backlog() -> None:
    ledger = InflightLedger()
    w0 = WorkerId("w0")
    # Two turns decoding, all but cached, then one long new prompt still in prefill.
    ledger.add("a", w0, 100_000, 1_000)
    ledger.add("b", w0, 100_000, 1_000)
    ledger.add("c", w0, 50_000, 40_000)
    ledger.add("x", WorkerId("w1"), 10, 10)
    ledger.check_invariants()
    assert ledger.share(w0) == pytest.approx(42_000 / 250_000)
    assert ledger.pending_share(w0, 50_000) == pytest.approx(0.8)  # "c" alone
    assert ledger.pending_share(w0, 60_000) == pytest.approx(41_000 / 150_000)  # "c" and "b"
    assert ledger.pending_share(w0, 0) == 1.0 and ledger.pending_share(WorkerId("w9"), 5) == 1.0
    ledger.remove("c", w0)
    ledger.add("a", w0, 100_000, 1_000)  # dispatched again: the newest now
    ledger.check_invariants()
    assert ledger.pending_share(w0, 100_000) == pytest.approx(0.01)
    for rid in ("a", "b"):
        ledger.remove(rid, w0)
    ledger.check_invariants()
    assert ledger.pending_share(w0, 10) == 1.0
