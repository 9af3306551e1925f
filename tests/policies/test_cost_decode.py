"""`cost`'s decode price (`policies.cost_decode`): the ledger, the count and the choice it moves."""

from __future__ import annotations

import dataclasses

import pytest

from policies.base import Observation, RouteRequest, WorkerId, WorkerView
from policies.config import CostParamsYaml, PolicyConfig
from policies.cost_decode import DecodeLedger, DecodePrice, pushed_over
from policies.cost_model import CostModel
from policies.cost_params import CostModelParams
from policies.cost_policy import CostPolicy
from tests.policies.factories import req

W0, W1 = WorkerId("w0"), WorkerId("w1")


def _count(decodes: list[tuple[int, float]], *, ahead_s: float = 0.0, own_s: float = 1.2) -> int:
    # A worker whose decode step is 10 ms; backlog steps of 0.3 s; this prefill: 4 steps of 0.3 s.
    return pushed_over(decodes, 10.0, 0.1, 0.01, ahead_s, 0.3, own_s, 0.3)


def test_a_short_answer_decoding_now_is_pushed_over_a_long_one_is_not() -> None:
    # 6 tokens left: 0.06 s at the normal step, 0.6 s allowed; four 0.3 s steps make 1.22 s.
    assert _count([(6, 10.0)]) == 1
    # 500 tokens: 5 s of 50 s allowed, and 1.16 s more is still within.
    assert _count([(500, 10.0)]) == 0
    # A prefill of one short step: 0.05 + 0.3 s is within 0.6 s.
    assert pushed_over([(6, 10.0)], 10.0, 0.1, 0.01, 0.0, 0.3, 0.3, 0.3) == 0
    assert _count([(6, 10.0), (6, 10.0), (500, 10.0)]) == 2


def test_only_the_decodes_within_the_objective_without_the_prefill_count() -> None:
    # Its decode steps alone (0.2 s each) are over 0.1 s: it misses anyway.
    assert pushed_over([(6, 10.0)], 10.0, 0.1, 0.2, 0.0, 0.5, 1.2, 0.5) == 0
    # Its first token 1 s ago: 6 tokens at 10 ms should be out, and its TPOT is over 0.1 s anyway.
    assert _count([(6, 9.0)]) == 0
    # Still in flight 0.4 s after its first token, though 5 tokens take 50 ms: it was slowed, and
    # its last token, still to come, takes it over 0.5 s in one of this prefill's steps.
    assert _count([(5, 9.6)]) == 1
    # Half done: 3 tokens left, all in the prefill's steps: 0.03 + 0.03 + 0.87 s over 0.6 s.
    assert _count([(6, 9.97)]) == 1


def test_the_backlog_ahead_decides_who_is_still_decoding_when_the_prefill_starts() -> None:
    # 6 tokens in steps of 0.3 s: done within a backlog of 2 s, before this prefill starts.
    assert _count([(6, 10.0)], ahead_s=2.0) == 0
    # A backlog of 0.9 s (three slow steps) already takes it over 0.6 s: it misses anyway.
    assert _count([(6, 10.0)], ahead_s=0.9) == 0
    # A longer answer is within with the backlog (0.9 + 0.17 s of 2.0 s) and over with both,
    # unless this prefill is short (two steps: 0.58 s more).
    assert _count([(20, 10.0)], ahead_s=0.9) == 1
    assert _count([(20, 10.0)], ahead_s=0.9, own_s=0.6) == 0
    # A request whose first token comes after the backlog and this prefill is not reached.
    assert _count([(6, 12.5)], ahead_s=0.9) == 0


def test_the_ledger_keeps_requests_with_a_tpot_per_worker() -> None:
    ledger = DecodeLedger()
    ledger.add("a", W0, 8, 1.0)
    ledger.add("b", W0, 1, 1.0)  # one token: no TPOT
    ledger.add("c", W0, None, 1.0)  # no limit: not known
    ledger.add("d", W1, 100, 2.0)
    assert ledger.by_worker == {W0: {"a": (7, 1.0)}, W1: {"d": (99, 2.0)}}
    ledger.remove("a", W0)
    ledger.remove("a", W0)  # twice, or never added: nothing
    ledger.remove("b", W0)
    assert ledger.by_worker == {W1: {"d": (99, 2.0)}} and len(ledger) == 1
    ledger.check_invariants()


def test_the_ledger_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DecodeLedger, "MAX_INFLIGHT", 2)
    ledger = DecodeLedger()
    for i in range(3):
        ledger.add(f"r{i}", W0, 8, 0.0)
    assert list(ledger.by_worker[W0]) == ["r1", "r2"]
    ledger.check_invariants()


def _price(objective_s: float | None) -> DecodePrice:
    return DecodePrice(4.0, 0.1, objective_s, DecodeLedger(), CostModel(CostModelParams()), 20_000, 0.0)


def test_a_prompt_is_charged_where_it_would_miss_the_ttft_objective() -> None:
    view = WorkerView(W0)
    # 20,000 new tokens: about 0.5 s of prefill; behind 1 s of queue it misses a 1.4 s objective.
    assert _price(1.4).charge(view, 0, 0.0, 0.0, 0, 1.0) == 4.0
    assert _price(1.4).charge(view, 0, 0.0, 0.0, 0, 0.1) == 0.0
    assert _price(None).charge(view, 0, 0.0, 0.0, 0, 1.0) == 0.0


def _short(rid: str, out: int, blocks: range) -> RouteRequest:
    return dataclasses.replace(req(rid, blocks), max_output_tokens=out)


def _decoding(policy: CostPolicy, rid: str, out: int, blocks: range, worker: WorkerId) -> None:
    """Dispatch `rid` to `worker` at t=0, with its first token predicted within milliseconds."""
    r = _short(rid, out, blocks)
    views = [WorkerView(worker)]
    d = policy.select(r, views, 0.0)
    assert d is not None and d.worker == worker
    policy.on_dispatch(r, d, 0.0)


def test_a_long_miss_is_kept_away_from_the_short_answers_it_would_slow() -> None:
    def views() -> list[WorkerView]:
        # Alike but for w1's short backlog, so that without the price w0 wins.
        return [
            WorkerView(W0, in_flight_requests=3, decode_context_tokens=600),
            WorkerView(W1, in_flight_requests=3, decode_context_tokens=600, in_flight_prefill_tokens=500),
        ]

    chosen = {}
    for price_s in (0.0, 4.0):
        p = CostPolicy(seed=1, decode_price_s=price_s)
        for i in range(3):
            _decoding(p, f"short{i}", 8, range(100 * i, 100 * i + 8), W0)
            _decoding(p, f"long{i}", 2000, range(1000 + 100 * i, 1000 + 100 * i + 8), W1)
        # 32k new tokens: four steps of about 0.3 s, which 7-token answers cannot absorb.
        d = p.select(_short("big", 50, range(5000, 7000)), views(), 0.01)
        assert d is not None
        chosen[price_s] = d.worker
        p._decodes.check_invariants()
    assert chosen == {0.0: W0, 4.0: W1}


def test_completions_leave_the_ledger() -> None:
    p = CostPolicy(seed=1, decode_price_s=4.0)
    r = _short("a", 8, range(8))
    d = p.select(r, [WorkerView(W0)], 0.0)
    assert d is not None
    p.on_dispatch(r, d, 0.0)
    assert "a" in p._decodes.by_worker[W0]
    p.on_complete(Observation(r, W0, ttft_s=0.05, prompt_tokens=r.n_prompt_tokens), 1.0)
    assert len(p._decodes) == 0
    # Off, nothing is kept.
    off = CostPolicy(seed=1)
    off.on_dispatch(r, d, 0.0)
    assert len(off._decodes) == 0


def test_the_options_are_checked() -> None:
    with pytest.raises(ValueError, match="decode_price_s"):
        CostPolicy(decode_price_s=-1.0)
    with pytest.raises(ValueError, match="tpot_objective_s"):
        CostPolicy(tpot_objective_s=0.0)
    config = PolicyConfig.model_validate({"cost": {"decode_price_s": 4.0, "tpot_objective_s": 0.2}})
    assert config.cost.decode_price_s == 4.0 and config.cost.tpot_objective_s == 0.2
    assert CostParamsYaml().decode_price_s == 0.0
