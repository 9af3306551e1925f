"""Which turns' clients waited for the answer before them (`policies.cost_turns`), and `cost`'s
looser stay bound for those turns (`stay_waited_within_s`)."""

from __future__ import annotations

import dataclasses

import pytest

from policies.base import Observation, WorkerId, WorkerView
from policies.cost_keep import first_token_s
from policies.cost_policy import CostPolicy
from policies.cost_turns import TurnChains
from tests.policies.factories import BS, chain, req, workers

W0, W1 = WorkerId("w0"), WorkerId("w1")


def _turn(n: int) -> tuple:  # the n-th turn of one session: its history and 4 blocks more
    return chain("t", range(4 * n))


def test_a_turn_sent_while_the_one_before_is_in_flight_marks_its_chain() -> None:
    turns = TurnChains()
    # The first turn matches nothing: no predecessor, so nothing shows a client that did not wait.
    assert turns.arrived(_turn(1), 0)
    turns.dispatched("t1", W0, _turn(1))
    # The second comes while the first is in flight (its match ends on the first's last block).
    assert not turns.arrived(_turn(2), 4)
    turns.dispatched("t2", W0, _turn(2))
    turns.ended("t1", W0)
    turns.ended("t2", W0)
    # The next three turns, each sent after the answer before it, still count as not waited for:
    # one overlap marks the chain for MEMORY_TURNS turns.
    for n in range(3, 3 + TurnChains.MEMORY_TURNS):
        assert not turns.arrived(_turn(n), 4 * (n - 1))
        turns.dispatched(f"t{n}", W0, _turn(n))
        turns.ended(f"t{n}", W0)
    n = 3 + TurnChains.MEMORY_TURNS
    assert turns.arrived(_turn(n), 4 * (n - 1))


def test_a_session_whose_client_always_waits_counts_as_waiting() -> None:
    turns = TurnChains()
    for n in range(1, 8):
        assert turns.arrived(_turn(n), 4 * (n - 1))
        turns.dispatched(f"t{n}", W0, _turn(n))
        turns.ended(f"t{n}", W0)
    # Nothing is kept of a chain that never overlapped (absent counts as 0).
    assert not turns._overlap
    assert not turns._in_flight and not turns._of


def test_two_equal_prompts_in_flight_are_counted_each() -> None:
    turns = TurnChains()
    turns.dispatched("a", W0, _turn(1))
    turns.dispatched("b", W1, _turn(1))
    turns.ended("a", W0)
    assert not turns.arrived(_turn(2), 4)  # "b" still in flight
    turns.ended("b", W1)
    turns.ended("b", W1)  # an outcome given twice changes nothing
    assert not turns._in_flight


def test_the_books_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TurnChains, "MAX_IN_FLIGHT", 4)
    monkeypatch.setattr(TurnChains, "MAX_CHAINS", 4)
    turns = TurnChains()
    for k in range(10):
        keys = chain(f"s{k}", range(4))
        turns.dispatched(f"r{k}", W0, keys)  # outcomes never come
        assert not turns.arrived(chain(f"s{k}", range(8)), 4)  # overlapped: marked
    assert len(turns._of) <= 4 and sum(turns._in_flight.values()) == len(turns._of)
    assert len(turns._overlap) <= 4


def _policy(**kw: object) -> CostPolicy:
    return CostPolicy(seed=1, **{"stay_tpot_s": 1.0, **kw})  # type: ignore[arg-type]


HISTORY = 2560  # blocks: 40,960 tokens, about 1.9 s to recompute on the default profile


def _w0_busy(p: CostPolicy, prev_in_flight: bool) -> list[WorkerView]:
    """w0 holds a session's history; in flight there, a prompt of the same size and all but cached:
    the session's previous turn (`prev_in_flight`), or another session's turn while the previous
    one has been answered. The policy's books are the same either way but for which prompt it is,
    and the views count 2M prompt tokens pending at w0, so the score moves the next turn."""
    warm = req("warm", range(HISTORY))
    d = p.select(warm, [WorkerView(W0)], 0.0)
    assert d is not None
    p.on_dispatch(warm, d, 0.0)
    p.on_complete(Observation(warm, d.worker, ttft_s=None, prompt_tokens=warm.n_prompt_tokens), 0.0)
    prev = req("prev", range(HISTORY + 1))
    d = p.select(prev, [WorkerView(W0)], 1.0)
    assert d is not None and d.worker == "w0"
    p.on_dispatch(prev, d, 1.0)
    if not prev_in_flight:
        p.on_complete(Observation(prev, d.worker, ttft_s=0.1, prompt_tokens=prev.n_prompt_tokens), 1.0)
        # Another session's prompt of the same size and match, in flight on w0 in its place.
        other = dataclasses.replace(req("other", range(HISTORY + 1)), request_id="other", tenant="u")
        p._ledger.add(other.request_id, W0, other.n_prompt_tokens, prev.n_prompt_tokens - HISTORY * BS)
    views = workers(1, 0, 0, 0, prefill=(2_000_000, 0, 0, 0))
    views[0] = dataclasses.replace(views[0], in_flight_prefill_pairs=1_000_000, prefill_started_s=1.0)
    return views


def test_the_looser_bound_keeps_only_turns_whose_client_waited() -> None:
    # Measure the holder's predicted first token `t` (the same in both cases): with an objective
    # at a quarter of it both the move and the holder miss it; the bound for turns sent without
    # waiting is below `t` (the move stands), the one for turns whose client waited above it.
    probe = _policy()
    views = _w0_busy(probe, prev_in_flight=True)
    nxt = req("next", range(HISTORY + 2))
    share = probe._ledger.pending_share(W0, views[0].in_flight_prefill_tokens)
    t = first_token_s(probe._pool(nxt).cost, views[0], share, HISTORY * BS, nxt.n_prompt_tokens, 1.1)
    assert 0 < t < 0.7
    settings = {"stay_objective_s": t / 4, "stay_within_s": t / 2, "stay_waited_within_s": 2 * t}
    for prev_in_flight, kept in ((True, False), (False, True)):
        p = _policy(**settings)
        views = _w0_busy(p, prev_in_flight)
        assert p._ledger.pending_share(W0, views[0].in_flight_prefill_tokens) == pytest.approx(share)
        d = p.select(nxt, views, 1.1)
        assert d is not None and (d.worker == "w0") is kept, prev_in_flight
        assert p.stats().counters.get("stays_within_objective", 0) == int(kept)
        p.check_invariants()
    # Off, a turn whose client waited has the one bound, and moves.
    p = _policy(stay_objective_s=t / 4, stay_within_s=t / 2, stay_waited_within_s=None)
    d = p.select(nxt, _w0_busy(p, prev_in_flight=False), 1.1)
    assert d is not None and d.worker != "w0"
    with pytest.raises(ValueError, match="stay_waited_within_s"):
        CostPolicy(stay_waited_within_s=-1.0)
