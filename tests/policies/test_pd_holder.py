"""`holder_prefill` mode: a request runs where the routing policy sends it, unless another worker
holds most of its prompt; then that worker prefills it and a lighter one decodes it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Role, RouteDecision, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from policies.pd import (
    ALONE_POLICY,
    ALONE_SOONER,
    ALONE_UNSPLITTABLE,
    HOLDER_PREFILL,
    SPLIT,
    WHOLE,
    PdRouter,
    PdSettings,
)
from policies.registry import make_policy
from tests.policies.factories import BS, req, workers
from tests.policies.test_pd import served, view

TURN1 = range(300)
TURN2 = [*range(300), 7, 8]


def strict_guard() -> CostPolicy:
    """`cost` whose bounded-load guard admits no worker above the mean (so a holder that decodes
    more than the others is not its pick)."""
    return CostPolicy(epsilon=0.0, slack_requests=0.0)


def strict_guard_with(prompt: range, worker: str) -> CostPolicy:
    """`strict_guard()` that has seen `worker` compute `prompt`."""
    policy = strict_guard()
    served(policy, req("turn1", prompt), worker)
    return policy


def mixed(*, m1_load: int = 0, **m1: object) -> list[WorkerView]:
    return [view("m0", Role.MIXED), view("m1", Role.MIXED, load=m1_load, **m1), view("m2", Role.MIXED)]


def holder_router(**fields: object) -> PdRouter:
    return PdRouter(PdSettings(mode=HOLDER_PREFILL, **fields))  # type: ignore[arg-type]


def test_a_session_moved_off_its_busy_holder_is_prefilled_there_and_decoded_elsewhere() -> None:
    r = req("turn2", TURN2)
    # The policy alone sends it elsewhere, to compute the whole prompt again.
    pick = strict_guard_with(TURN1, "m1").select(r, mixed(m1_load=2), 1.0)
    assert pick is not None and pick.worker != "m1"
    decision = holder_router().select(strict_guard_with(TURN1, "m1"), r, mixed(m1_load=2), 1.0)
    assert decision is not None and decision.reason == SPLIT
    assert decision.prefill is not None and decision.prefill.worker == "m1"
    assert decision.prefill.matched_tokens == 300 * 16 and decision.prefill.reason == "hit"
    assert decision.decode.worker in ("m0", "m2")
    # The decode worker holds none of it: the whole prompt moves.
    assert decision.transfer_tokens == r.n_prompt_tokens
    assert decision.decode.matched_tokens == r.n_prompt_tokens


def test_a_request_the_policy_sends_to_its_holder_runs_there_alone() -> None:
    policy = strict_guard_with(TURN1, "m1")
    decision = holder_router().select(policy, req("turn2", TURN2), mixed(), 1.0)
    assert decision is not None and decision.skip_prefill
    assert decision.reason == ALONE_POLICY and decision.decode.worker == "m1"
    assert decision.decode.matched_tokens == 300 * 16


def test_a_holder_of_less_than_the_share_is_not_asked_to_prefill() -> None:
    policy = strict_guard_with(range(100), "m1")
    r = req("turn2", [*range(100), *range(1000, 1200)])  # a third of it held
    decision = holder_router().select(policy, r, mixed(m1_load=2), 1.0)
    assert decision is not None and decision.skip_prefill and decision.reason == ALONE_POLICY
    assert decision.decode.worker != "m1"
    # With a lower share the same holder prefills it.
    split = holder_router(holder_share=0.25).select(
        strict_guard_with(range(100), "m1"), r, mixed(m1_load=2), 1.0
    )
    assert split is not None and split.reason == SPLIT and split.prefill is not None
    assert split.prefill.worker == "m1"


def test_a_holder_with_a_long_prefill_queue_loses_to_computing_it_again() -> None:
    policy = strict_guard_with(TURN1, "m1")
    # Minutes of prompts waiting on the holder: recomputing 4.8k tokens elsewhere is sooner.
    decision = holder_router().select(
        policy, req("turn2", TURN2), mixed(m1_load=2, in_flight_prefill_tokens=2_000_000), 1.0
    )
    assert decision is not None and decision.skip_prefill and decision.reason == ALONE_SOONER
    assert decision.decode.worker != "m1"


def test_whole_and_unsplittable_requests_run_on_the_policys_pick() -> None:
    router = holder_router()
    whole = router.select(strict_guard_with(TURN1, "m1"), req("e", TURN2), mixed(m1_load=2), 1.0, whole=True)
    assert whole is not None and whole.skip_prefill and whole.reason == WHOLE
    one = router.select(
        strict_guard_with(TURN1, "m1"), req("n", TURN2), mixed(m1_load=2), 1.0, splittable=False
    )
    assert one is not None and one.skip_prefill and one.reason == ALONE_UNSPLITTABLE


def test_a_policy_without_an_index_is_followed() -> None:
    policy = make_policy("round_robin")
    decision = holder_router().select(policy, req("r", TURN2), mixed(m1_load=2), 1.0)
    assert decision is not None and decision.skip_prefill and decision.reason == ALONE_POLICY


def test_holder_share_is_a_fraction() -> None:
    with pytest.raises(ValueError, match="holder_share"):
        PdSettings(mode=HOLDER_PREFILL, holder_share=1.0)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=6),
    st.booleans(),
    st.integers(1, 60),
)
def test_holder_mode_splits_only_from_the_longest_holder_to_another_healthy_worker(
    spec: list[tuple[bool, int, int]], splittable: bool, blocks: int
) -> None:
    policy = strict_guard()
    workers = [view(f"w{i}", Role.MIXED, load=load, healthy=ok) for i, (ok, load, _) in enumerate(spec)]
    for i, (_, _, held_blocks) in enumerate(spec):
        if held_blocks:
            served(policy, req(f"warm{i}", range(held_blocks * 10)), f"w{i}")
    r = req("r", range(blocks))
    held = policy.held_tokens(r, 0, 1.0)
    decision = holder_router().select(policy, r, workers, 1.0, splittable=splittable)
    healthy = {w.worker_id for w in workers if w.healthy}
    if decision is None:
        assert not healthy
        return
    assert decision.decode.worker in healthy
    if decision.prefill is None:
        assert decision.transfer_tokens == 0
        return
    p = decision.prefill.worker
    assert splittable and decision.reason == SPLIT and p in healthy and p != decision.decode.worker
    assert held.get(p, 0) == max(held.get(w, 0) for w in healthy)
    assert held.get(p, 0) > r.n_prompt_tokens / 2
    policy.check_invariants()


def _busy_with_cached_turns() -> tuple[CostPolicy, list[WorkerView]]:
    """`cost` whose w0 holds a prefix and runs eight more turns of it, almost all cached: as whole
    prompts its backlog looks long, as tokens left to compute it is nearly empty."""
    policy = CostPolicy(seed=1)
    served(policy, req("warm", range(64)), "w0")
    for i in range(8):
        r = req(f"f{i}", range(64))
        d = policy.select(r, [WorkerView(WorkerId("w0"))], 1.0)
        assert d is not None
        policy.on_dispatch(r, d, 1.0)
    return policy, workers(8, 0, 0, 0, prefill=(8 * (64 * BS + 1), 0, 0, 0))


def test_a_pool_that_moves_kv_counts_backlogs_in_tokens_left_to_compute() -> None:
    # Alone, `cost` takes the holder's mostly-cached backlog for a queue and recomputes elsewhere.
    policy, views = _busy_with_cached_turns()
    d = policy.select(req("r", range(64)), views, 1.0)
    assert d is not None and d.worker != "w0" and not policy.discounts_backlog("p")
    # In a holder_prefill pool the session stays with its holder (its decode can move if needed).
    policy, views = _busy_with_cached_turns()
    decision = holder_router().select(policy, req("r", range(64)), views, 1.0)
    assert decision is not None and decision.reason == ALONE_POLICY and decision.decode.worker == "w0"
    assert policy.discounts_backlog("p") and not policy.discounts_backlog("other-pool")
    # An explicit setting wins either way.
    pinned = CostPolicy(seed=1, discount_cached_backlog=False)
    holder_router().select(pinned, req("r", range(64)), views, 1.0)
    assert not pinned.discounts_backlog("p")
    assert CostPolicy(discount_cached_backlog=True).discounts_backlog("p")
    # `holders` leaves a pool that moves KV counting every backlog so, as the default does there.
    holders = CostPolicy(seed=1, discount_cached_backlog="holders")
    holder_router().select(holders, req("r", range(64)), views, 1.0)
    assert holders.discounts_backlog("p") and not holders.discounts_holders("p")
    assert holders.discounts_holders("other-pool") and not holders.discounts_backlog("other-pool")


@pytest.mark.parametrize("discount", [None, False])
def test_the_split_counts_the_holders_backlog_as_the_policy_does(discount: bool | None) -> None:
    # m1 holds the session and runs four more turns of it, almost all cached; the guard turns it
    # away (it runs more requests than the others). Counted as whole prompts its backlog looks
    # longer than recomputing the turn elsewhere; counted as what is left, the split wins.
    policy = CostPolicy(epsilon=0.0, slack_requests=0.0, discount_cached_backlog=discount)
    served(policy, req("turn1", TURN1), "m1")
    for i in range(4):
        policy.on_dispatch(req(f"busy{i}", TURN1), RouteDecision(WorkerId("m1"), 0.0, "hit", 300 * 16), 1.0)
    views = mixed(m1_load=4, in_flight_prefill_tokens=4 * req("busy", TURN1).n_prompt_tokens)
    decision = holder_router().select(policy, req("turn2", TURN2), views, 1.0)
    assert decision is not None and decision.decode.worker != "m1"
    if discount is None:  # a holder_prefill pool: backlogs in tokens left to compute
        assert decision.reason == SPLIT and decision.prefill is not None and decision.prefill.worker == "m1"
    else:
        assert decision.reason == ALONE_SOONER and decision.prefill is None
