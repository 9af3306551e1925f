"""P/D pair choice: the prefill worker by the policy's score, the decode worker by load, free KV
and the transfer it needs, and conditional disaggregation by the same score."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Observation, Role, RouteDecision, RouteRequest, WorkerId, WorkerView
from policies.config import PolicyConfig, build_policy
from policies.cost_policy import CostPolicy
from policies.pd import (
    ALONE_NO_PAIR,
    ALONE_SOONER,
    ALONE_UNSPLITTABLE,
    SGLANG_ROLES,
    SPLIT,
    VLLM_ROLES,
    PdRouter,
    PdSettings,
)
from policies.registry import make_policy
from tests.policies.factories import req


def view(name: str, role: Role, *, load: int = 0, decode_tokens: int = 0, **fields: object) -> WorkerView:
    return WorkerView(
        WorkerId(name),
        role=role,
        in_flight_requests=load,
        in_flight_decode_tokens=decode_tokens,
        **fields,  # type: ignore[arg-type]
    )


def served(policy: CostPolicy, r: RouteRequest, worker: str, now_s: float = 0.0) -> None:
    """Teach the policy that `worker` computed (and so holds) `r`'s prompt."""
    decision = RouteDecision(WorkerId(worker), 0.0, "test")
    policy.on_dispatch(r, decision, now_s)
    policy.on_complete(Observation(r, WorkerId(worker), 0.1, r.n_prompt_tokens, 0, 1), now_s)


def pool() -> list[WorkerView]:
    return [
        view("p0", Role.PREFILL),
        view("p1", Role.PREFILL),
        view("d0", Role.DECODE),
        view("d1", Role.DECODE),
    ]


def test_a_new_prompt_is_split_and_its_prefill_goes_where_the_prefix_is() -> None:
    policy = CostPolicy()
    served(policy, req("old", range(200)), "p1")
    router = PdRouter(PdSettings())
    decision = router.select(policy, req("new", [*range(200), 999]), pool(), 1.0)
    assert decision is not None and not decision.skip_prefill
    assert decision.reason == SPLIT and decision.prefill is not None
    assert decision.prefill.worker == "p1" and decision.prefill.matched_tokens == 200 * 16
    assert decision.decode.worker in ("d0", "d1")
    # The decode worker holds nothing: the whole prompt moves, and then it holds all of it.
    assert decision.transfer_tokens == 201 * 16 + 1
    assert decision.decode.matched_tokens == 201 * 16 + 1


def test_a_prompt_mostly_cached_on_a_decode_worker_skips_the_split() -> None:
    policy = CostPolicy()
    served(policy, req("turn1", range(300)), "d1")
    router = PdRouter(PdSettings())
    decision = router.select(policy, req("turn2", [*range(300), 7, 8]), pool(), 1.0)
    assert decision is not None and decision.skip_prefill
    assert decision.reason == ALONE_SOONER and decision.decode.worker == "d1"
    assert decision.decode.matched_tokens == 300 * 16


def test_without_conditional_disaggregation_the_same_prompt_is_split() -> None:
    policy = CostPolicy()
    served(policy, req("turn1", range(300)), "d1")
    router = PdRouter(PdSettings(conditional=False))
    decision = router.select(policy, req("turn2", [*range(300), 7, 8]), pool(), 1.0)
    assert decision is not None and decision.reason == SPLIT
    # It decodes where the prefix is: only the two new blocks (and the last token) move.
    assert decision.decode.worker == "d1" and decision.transfer_tokens == 2 * 16 + 1


def test_a_busy_decode_worker_is_not_asked_to_prefill_much() -> None:
    # D holds a third of the prompt but decodes 64 requests: prefilling the rest there would stall
    # every one of them, so the request is split. With no weight on their delay, the lone worker's
    # own time wins (it saves the cached third and the transfer).
    policy = CostPolicy()
    served(policy, req("head", range(100)), "d1")
    workers = [view("p0", Role.PREFILL), view("d1", Role.DECODE, load=64)]
    decision = PdRouter(PdSettings()).select(policy, req("long", range(300)), workers, 1.0)
    assert decision is not None and decision.reason == SPLIT
    selfish = PdRouter(PdSettings(interference_weight=0.0))
    decision = selfish.select(policy, req("long2", range(300)), workers, 1.0)
    assert decision is not None and decision.reason == ALONE_SOONER and decision.decode.worker == "d1"


def test_the_decode_worker_is_the_less_loaded_one_and_one_with_room() -> None:
    policy = CostPolicy()
    workers = [
        view("p0", Role.PREFILL),
        view("d0", Role.DECODE, load=40, decode_tokens=40 * 2000),
        view("d1", Role.DECODE, load=2, decode_tokens=2 * 2000),
    ]
    router = PdRouter(PdSettings(conditional=False))
    decision = router.select(policy, req("r", range(50)), workers, 0.0)
    assert decision is not None and decision.decode.worker == "d1"
    # The idle one has no free KV left for the request: the loaded one is chosen.
    full = dataclasses.replace(workers[2], kv_usage=0.999, num_gpu_blocks=1000, engine_block_size=16)
    decision = router.select(policy, req("r2", range(50)), [*workers[:2], full], 0.0)
    assert decision is not None and decision.decode.worker == "d0"


def test_without_a_prefill_worker_the_decode_worker_serves_alone() -> None:
    policy = CostPolicy()
    workers = [view("p0", Role.PREFILL, healthy=False), view("d0", Role.DECODE)]
    decision = PdRouter(PdSettings(conditional=False)).select(policy, req("r", range(10)), workers, 0.0)
    assert decision is not None and decision.reason == ALONE_NO_PAIR and decision.decode.worker == "d0"


def test_an_unsplittable_request_runs_alone_and_the_policy_is_not_asked_for_a_prefill() -> None:
    policy = CostPolicy()
    decision = PdRouter(PdSettings()).select(policy, req("r", range(10)), pool(), 0.0, splittable=False)
    assert decision is not None and decision.reason == ALONE_UNSPLITTABLE
    assert decision.decode.worker in ("d0", "d1")
    assert policy.stats().decisions_by_reason == {}


def test_a_mixed_worker_is_never_paired_with_itself() -> None:
    policy = CostPolicy()
    workers = [view("m0", Role.MIXED)]
    decision = PdRouter(PdSettings(conditional=False)).select(policy, req("r", range(10)), workers, 0.0)
    # vLLM: the only candidate for both halves; no pair exists, so it serves alone.
    assert decision is not None and decision.skip_prefill and decision.decode.worker == "m0"
    assert decision.reason == ALONE_NO_PAIR


def test_sglang_pairs_prefill_with_decode_workers_and_mixed_ones_serve_alone() -> None:
    policy = CostPolicy()
    router = PdRouter(PdSettings(roles=SGLANG_ROLES, conditional=False))
    workers = [view("p0", Role.PREFILL), view("m0", Role.MIXED), view("d0", Role.DECODE)]
    decision = router.select(policy, req("r", range(10)), workers, 0.0)
    assert decision is not None and decision.prefill is not None
    assert (decision.prefill.worker, decision.decode.worker) == ("p0", "d0")
    # A decode worker cannot serve alone under SGLang: with the prefill worker down, only mixed can.
    down = [dataclasses.replace(workers[0], healthy=False), *workers[1:]]
    decision = router.select(policy, req("r2", range(10)), down, 0.0)
    assert decision is not None and decision.decode.worker == "m0" and decision.skip_prefill
    assert router.select(policy, req("r3", range(10)), [down[0], down[2]], 0.0) is None


def test_a_round_robin_prefill_choice_still_pairs_by_decode_load() -> None:
    policy = make_policy("round_robin")
    router = PdRouter(PdSettings(conditional=False))
    workers = [*pool()[:2], view("d0", Role.DECODE, load=30), view("d1", Role.DECODE)]
    chosen = []
    for i in range(4):
        decision = router.select(policy, req(f"r{i}", range(20)), workers, 0.0)
        assert decision is not None and decision.prefill is not None and decision.decode.worker == "d1"
        chosen.append(decision.prefill.worker)
    assert chosen == ["p0", "p1", "p0", "p1"]


def test_an_alone_decision_recalibrates_against_the_decode_worker() -> None:
    policy = CostPolicy()
    served(policy, req("turn1", range(300)), "d1")
    r = req("turn2", [*range(300), 7])
    decision = PdRouter(PdSettings()).select(policy, r, pool(), 1.0)
    assert decision is not None and decision.skip_prefill
    cost = policy.cost_model(r)
    before = cost.calibration_samples
    # The decode worker reports its own hit: the model learns nothing wrong from it (too little new
    # compute), and the pending record is the decode worker's (matched = its held prefix).
    policy.on_dispatch(r, decision.decode, 1.0)
    policy.on_complete(Observation(r, WorkerId("d1"), 0.05, r.n_prompt_tokens, 300 * 16, 1), 1.1)
    assert cost.calibration_samples == before and cost.pending_requests == 0


def test_transfer_time_is_setup_plus_bytes_over_bandwidth() -> None:
    s = PdSettings(
        transfer_setup_s=0.001, transfer_bytes_per_token=131_072, transfer_bandwidth_bytes_per_s=45e9
    )
    assert s.transfer_s(0) == 0.0
    assert s.transfer_s(4096) == pytest.approx(0.001 + 4096 * 131_072 / 45e9)
    with pytest.raises(ValueError):
        PdSettings(transfer_bandwidth_bytes_per_s=0)


def test_the_policy_file_builds_a_policy_that_answers_pd_questions() -> None:
    policy = build_policy(PolicyConfig())
    r = req("r", range(4))
    assert isinstance(policy, CostPolicy) and policy.held_tokens(r, 0, 0.0) == {}


ROLES = st.sampled_from([Role.PREFILL, Role.DECODE, Role.MIXED])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(ROLES, st.booleans(), st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=6),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(1, 60),
)
def test_decisions_respect_roles_health_and_protocol(
    spec: list[tuple[Role, bool, int, int]], sglang: bool, conditional: bool, splittable: bool, blocks: int
) -> None:
    policy = CostPolicy()
    workers = [
        view(f"w{i}", role, load=load, healthy=healthy) for i, (role, healthy, load, _) in enumerate(spec)
    ]
    for i, (_, _, _, held_blocks) in enumerate(spec):
        if held_blocks:
            served(policy, req(f"warm{i}", range(held_blocks * 10)), f"w{i}")
    roles = SGLANG_ROLES if sglang else VLLM_ROLES
    router = PdRouter(PdSettings(roles=roles, conditional=conditional))
    decision = router.select(policy, req("r", range(blocks)), workers, 1.0, splittable=splittable)
    by_id = {w.worker_id: w for w in workers}
    healthy = [w for w in workers if w.healthy]
    can_prefill = splittable and any(w.role in roles.prefill for w in healthy)
    can_alone = any(w.role in roles.alone for w in healthy)
    decoders = [w for w in healthy if w.role in roles.decode]
    if decision is None:
        assert not can_alone
        assert not (
            can_prefill and (len(decoders) >= 2 or any(w.role not in roles.prefill for w in decoders))
        )
        return
    d = by_id[decision.decode.worker]
    assert d.healthy
    if decision.prefill is None:
        assert d.role in roles.alone and decision.transfer_tokens == 0
        assert conditional or decision.reason in (ALONE_NO_PAIR, ALONE_UNSPLITTABLE)
        assert decision.reason != ALONE_NO_PAIR or not (can_prefill and len(decoders) >= 2)
        assert splittable or decision.reason == ALONE_UNSPLITTABLE
    else:
        p = by_id[decision.prefill.worker]
        assert splittable and p.healthy and p.role in roles.prefill and d.role in roles.decode
        assert p.worker_id != d.worker_id and decision.transfer_tokens > 0
        assert decision.reason == SPLIT
    policy.check_invariants()
