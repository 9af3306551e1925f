"""`cost`'s in-flight ledger under SGLang's prefill/decode protocol, where both legs of one request
are in flight at once, one on each worker, under the request's one id.

The gateway tells the policy of each leg as of any dispatch (`on_dispatch`, then `on_complete`
with the leg's worker). Before, the ledger kept one entry per request id: the decode leg's
dispatch replaced the prefill leg's entry, and the prefill leg's completion then took out the
decode leg's. While its prefill ran, the prefill worker's backlog (the gateway's in-flight prompt
tokens, this request's among them) was counted at the share of its other requests, or whole when
it had none: with `discount_cached_backlog`, a prefill worker busy with mostly-cached prompts
looked seconds away."""

from __future__ import annotations

import pytest

from policies.base import Observation, Outcome, RouteDecision, RouteRequest, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from tests.policies.factories import BS, req, workers

PREFILL, DECODE = WorkerId("w0"), WorkerId("d0")


def _split(p: CostPolicy, r: RouteRequest, now_s: float) -> None:
    """Dispatch `r` as an SGLang pair: its prefill leg where the policy picks (w0, the holder),
    its decode leg on d0 at once, which receives the whole prompt's KV (nothing to compute)."""
    prefill = p.select(r, [WorkerView(PREFILL)], now_s)
    assert prefill is not None and prefill.worker == PREFILL
    p.on_dispatch(r, prefill, now_s)
    p.on_dispatch(r, RouteDecision(DECODE, 0.0, "split", r.n_prompt_tokens), now_s)


def _warm(p: CostPolicy) -> None:
    r = req("warm", range(64))
    d = p.select(r, [WorkerView(PREFILL)], 0.0)
    assert d is not None
    p.on_dispatch(r, d, 0.0)
    p.on_complete(Observation(r, d.worker, prompt_tokens=r.n_prompt_tokens), 0.0)


def test_both_legs_of_a_pair_in_flight_are_each_counted_on_their_worker() -> None:
    p = CostPolicy(seed=1, discount_cached_backlog=True)
    _warm(p)
    r = req("r", range(64))
    _split(p, r, 1.0)
    n = r.n_prompt_tokens
    assert p.uncached_share(PREFILL) == pytest.approx(1 / n)  # one token past the cached prefix
    assert p.uncached_share(DECODE) == 0.0
    # The prefill leg ends first: the decode leg is still in flight, with nothing to compute.
    p.on_complete(Observation(r, PREFILL, prompt_tokens=n, cached_tokens=n - 1), 2.0)
    assert p.uncached_share(PREFILL) == 1.0
    assert p.uncached_share(DECODE) == 0.0
    p.on_complete(Observation(r, DECODE, prompt_tokens=n), 3.0)
    assert p.uncached_share(DECODE) == 1.0
    p._ledger.check_invariants()
    p.check_invariants()


def test_a_failed_leg_takes_out_only_its_own_entry() -> None:
    p = CostPolicy(seed=1, discount_cached_backlog=True)
    _warm(p)
    r = req("r", range(64))
    _split(p, r, 1.0)
    p.on_complete(Observation(r, DECODE, outcome=Outcome.WORKER_FAILED), 1.5)
    assert p.uncached_share(DECODE) == 1.0
    assert p.uncached_share(PREFILL) == pytest.approx(1 / r.n_prompt_tokens)
    p._ledger.check_invariants()
    p.on_complete(Observation(r, PREFILL, outcome=Outcome.ABORTED), 1.6)
    assert p.uncached_share(PREFILL) == 1.0
    p._ledger.check_invariants()


def test_a_prefill_worker_busy_with_cached_prompts_of_pairs_is_still_chosen() -> None:
    """As `test_a_holder_busy_with_cached_prompts_is_not_taken_for_a_long_queue`, the requests in
    flight on the holder being the prefill legs of pairs."""
    p = CostPolicy(seed=1, discount_cached_backlog=True)
    _warm(p)
    for i in range(8):
        _split(p, req(f"f{i}", range(64)), 1.0)
    views = workers(8, 0, 0, 0, prefill=(8 * (64 * BS + 1), 0, 0, 0))
    d = p.select(req("r", range(64)), views, 1.0)
    assert d is not None and d.worker == PREFILL


def test_each_leg_confirms_its_own_holdings() -> None:
    """The decode worker already holds the whole prompt (its dispatch leaves nothing to confirm),
    the prefill worker none of it: the prefill leg's completion confirms the prefill worker's
    holdings, whatever the decode leg's dispatch left."""
    p = CostPolicy(seed=1)
    r = req("r", range(64))
    warm = RouteDecision(DECODE, 0.0, "hit", r.n_prompt_tokens)
    p.on_dispatch(r, warm, 0.0)
    p.on_complete(Observation(r, DECODE, prompt_tokens=r.n_prompt_tokens), 0.5)
    assert p.stats().index["p"].speculative_entries == 0
    again = req("r2", range(64))
    _split(p, again, 1.0)
    assert p.stats().index["p"].speculative_entries > 0  # on the prefill worker
    p.on_complete(Observation(again, PREFILL, prompt_tokens=again.n_prompt_tokens), 2.0)
    assert p.stats().index["p"].speculative_entries == 0
    p.on_complete(Observation(again, DECODE, prompt_tokens=again.n_prompt_tokens), 3.0)
    p.check_invariants()
