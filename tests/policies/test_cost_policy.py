from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Observation, Outcome, RouteRequest, WorkerId, WorkerView
from policies.cost_params import profile
from policies.cost_policy import CostPolicy
from policies.index import IndexConfig
from policies.pools import PoolSettings, load_of
from policies.prefix_policy import SharedSettings
from tests.policies.factories import BS, req, workers


def _policy(**kw: object) -> CostPolicy:
    return CostPolicy(seed=1, **kw)  # type: ignore[arg-type]


def _warm(policy: CostPolicy, blocks: range, worker: str, *, tenant: str = "t") -> None:
    """Dispatch and complete one request so `worker` holds `blocks` (confirmed)."""
    r = req(f"warm-{worker}-{tenant}", blocks, tenant=tenant)
    d = policy.select(r, [WorkerView(WorkerId(worker))], 0.0)
    assert d is not None
    policy.on_dispatch(r, d, 0.0)
    policy.on_complete(Observation(r, d.worker, ttft_s=None, prompt_tokens=r.n_prompt_tokens), 0.0)


def test_routes_to_the_holder_of_a_long_prefix() -> None:
    p = _policy()
    _warm(p, range(128), "w2")
    d = p.select(req("r", range(130)), workers(0, 0, 0, 0), 1.0)
    assert d is not None and d.worker == "w2" and d.reason == "hit"
    assert d.matched_tokens == 128 * BS and d.score_s > 0
    p.check_invariants()


def test_misses_on_an_idle_pool_spread_instead_of_piling_on_worker_0() -> None:
    p = _policy()
    chosen = {
        p.select(req(f"r{i}", range(i * 100, i * 100 + 8)), workers(0, 0, 0, 0), 0.0) for i in range(40)
    }
    assert len({d.worker for d in chosen if d is not None}) == 4
    assert p.stats().decisions_by_reason == {"miss": 40}


def test_hot_prefix_is_replicated_when_its_holder_is_queued() -> None:
    p = _policy()
    _warm(p, range(64), "w0")
    # w0 holds 1k tokens of prefix but has 200k prefill tokens queued: a fresh prefill elsewhere wins.
    views = workers(2, 0, 0, 0, prefill=(200_000, 0, 0, 0))
    d = p.select(req("r", range(66)), views, 1.0)
    assert d is not None and d.worker != "w0" and d.reason == "spread"
    assert p.stats().counters["hot_prefix_replications"] == 1
    # A short queue is worth waiting behind: it stays on the holder.
    d2 = p.select(req("r2", range(66)), workers(1, 0, 0, 0, prefill=(500, 0, 0, 0)), 1.0)
    assert d2 is not None and d2.worker == "w0"


def test_bounded_load_guard_moves_off_an_overloaded_holder() -> None:
    p = _policy()
    _warm(p, range(256), "w0")
    d = p.select(req("r", range(258)), workers(10, 0, 0, 0), 1.0)
    assert d is not None and d.worker != "w0" and d.reason == "spread"
    assert p.stats().counters["holders_past_guard"] == 1  # the guard's move, not the score's
    d1 = p.select(req("r1", range(258)), workers(1, 0, 0, 0), 1.0)
    assert d1 is not None and d1.worker == "w0"
    assert p.stats().counters["holders_past_guard"] == 1
    strict = _policy(epsilon=0.0, slack_requests=0.0)
    d2 = strict.select(req("r", range(3)), workers(2, 2, 2, 2), 1.0)
    assert d2 is not None and d2.reason == "overloaded"


def test_continuation_slack_gives_a_holder_of_most_of_the_prompt_more_room() -> None:
    # w0's load (10) is over the guard's bound (9.75), but it holds all but the last blocks of the
    # prompt: with `continuation_slack_requests` the session continues there instead of recomputing
    # its history on an idle worker, up to that many requests past the bound.
    p = _policy(continuation_slack_requests=8.0)
    _warm(p, range(256), "w0")
    d = p.select(req("r", range(258)), workers(10, 0, 0, 0), 1.0)
    assert d is not None and d.worker == "w0" and d.reason == "hit"
    # Past the extra room (bound 14.75 + 8 here), the guard applies.
    d1 = p.select(req("r1", range(258)), workers(30, 0, 0, 0), 1.0)
    assert d1 is not None and d1.worker != "w0" and d1.reason == "spread"
    # A holder of only half the prompt (a new branch) gets no extra room.
    branch = req("r2", [*range(256), *range(1000, 1256)])
    d2 = p.select(branch, workers(10, 0, 0, 0), 1.0)
    assert d2 is not None and d2.worker != "w0"


def test_a_holder_past_the_guard_keeps_a_session_whose_move_would_recompute_too_much() -> None:
    # w0 (10 in flight, over the guard's bound of 9.75) holds all but the last blocks of the
    # prompt. With `max_recompute_s` below the prefill seconds it saves, the session stays past
    # any bound (here 30 in flight); above them, the guard moves it as before.
    r = req("r", range(258))
    for load in (10, 30):
        p = _policy(max_recompute_s=0.01)
        _warm(p, range(256), "w0")
        assert p._pool(r).cost.saved_s(258 * BS, 256 * BS) > 0.01
        d = p.select(r, workers(load, 0, 0, 0), 1.0)
        assert d is not None and d.worker == "w0" and d.reason == "hit"
    long_limit = _policy(max_recompute_s=1000.0)
    _warm(long_limit, range(256), "w0")
    d1 = long_limit.select(req("r1", range(258)), workers(10, 0, 0, 0), 1.0)
    assert d1 is not None and d1.worker != "w0" and d1.reason == "spread"
    # A holder of only half the prompt (a new branch) is not kept past the guard.
    p = _policy(max_recompute_s=0.01)
    _warm(p, range(256), "w0")
    branch = req("r2", [*range(256), *range(1000, 1256)])
    d2 = p.select(branch, workers(10, 0, 0, 0), 1.0)
    assert d2 is not None and d2.worker != "w0"
    with pytest.raises(ValueError, match="max_recompute_s"):
        _policy(max_recompute_s=0.0)


def test_a_holder_past_the_guard_keeps_a_session_while_its_decode_batch_can_take_it() -> None:
    # w0 (10 in flight, over the guard's bound of 9.75) holds all but the last blocks of the prompt.
    # With `keep_tpot_s`, it keeps the session while its decode step with the request's decode
    # added, c·(requests + 1) + d·context, stays within the bound: a light batch keeps it, a batch
    # decoding 2 M tokens of context (about 0.11 s a step) does not, and the session moves.
    p = _policy(keep_tpot_s=0.05)
    _warm(p, range(256), "w0")
    r = req("r", range(258))
    views = workers(10, 0, 0, 0)
    light = [dataclasses.replace(views[0], decode_context_tokens=100_000), *views[1:]]
    d = p.select(r, light, 1.0)
    assert d is not None and d.worker == "w0" and d.reason == "hit"
    heavy = [dataclasses.replace(light[0], decode_context_tokens=2_000_000), *light[1:]]
    d1 = p.select(req("r1", range(258)), heavy, 1.0)
    assert d1 is not None and d1.worker != "w0" and d1.reason == "spread"
    cost = p._pool(r).cost
    assert cost.decode_step_s(11, 2_000_000 + 258 * BS) > 0.1
    # Without the bound (the default), the guard moves the session off even a light holder.
    plain = _policy()
    _warm(plain, range(256), "w0")
    d2 = plain.select(r, light, 1.0)
    assert d2 is not None and d2.worker != "w0"
    # Past the bound only holders of most of the prompt are kept: a new branch still moves.
    branch = req("r2", [*range(256), *range(1000, 1256)])
    d3 = p.select(branch, light, 1.0)
    assert d3 is not None and d3.worker != "w0"


def test_a_prompt_that_cannot_meet_the_objective_goes_where_it_delays_the_fewest() -> None:
    # 64k new tokens: about 4 s of prefill on an idle worker, over a 1 s objective anywhere.
    long_miss = req("long", range(4000))
    views = workers(3, 1, 1, 5, prefill=(0, 0, 40_000, 0))
    plain = _policy().select(long_miss, views, 1.0)
    assert plain is not None and plain.worker == "w0"  # the soonest start: no backlog
    p = _policy(ttft_objective_s=1.0)
    d = p.select(long_miss, views, 1.0)
    # The fewest requests in flight (w1, w2), then the one already busy with a long prompt.
    assert d is not None and d.worker == "w2" and d.reason == "miss"
    assert p.stats().counters["objective_lanes"] == 1
    # A prompt that can meet it is scored as without the objective.
    short = p.select(req("short", range(5000, 5200)), views, 1.0)
    assert short is not None and short.worker == "w0"
    # So is one that matches a prefix: its holder saves it the most.
    _warm(p, range(2000), "w3")
    lanes = p.stats().counters["objective_lanes"]
    held = p.select(req("held", range(4000)), views, 1.0)
    assert held is not None and held.reason != "miss"
    assert p.stats().counters["objective_lanes"] == lanes


def test_the_objective_lane_keeps_to_the_load_guard() -> None:
    p = _policy(ttft_objective_s=1.0, epsilon=0.0, slack_requests=1.0)
    # w1 has the fewest requests but the longest backlog; w3 is past the guard (mean 2.5 + 1).
    d = p.select(req("long", range(4000)), workers(2, 1, 2, 5, prefill=(0, 9_000, 0, 0)), 1.0)
    assert d is not None and d.worker == "w1"
    with pytest.raises(ValueError, match="ttft_objective_s"):
        _policy(ttft_objective_s=0.0)


def test_cold_adapter_outweighs_a_short_prefix() -> None:
    p = _policy()
    _warm(p, range(16), "w0")
    r = req("r", range(18))
    r = type(r)(**{**{f: getattr(r, f) for f in r.__slots__}, "adapter": "sql"})
    views = [
        WorkerView(WorkerId("w0"), loaded_adapters=frozenset()),
        WorkerView(WorkerId("w1"), loaded_adapters=frozenset({"sql"})),
    ]
    d = p.select(r, views, 1.0)
    assert d is not None and d.worker == "w1"


def test_transfer_lets_a_quiet_worker_borrow_a_long_prefix() -> None:
    params = profile("llama3-8b-h100", transfer_enabled=True, transfer_bandwidth_bytes_per_s=1e12)
    p = _policy(shared=SharedSettings(default_pool=PoolSettings(cost=params)))
    _warm(p, range(1024), "w0")
    views = workers(3, 0, prefill=(100_000, 0))
    d = p.select(req("r", range(1030)), views, 1.0)
    assert d is not None and d.worker == "w1" and d.matched_tokens == 1024 * BS


def test_speculative_routing_memory_expires_without_feedback() -> None:
    p = _policy(shared=SharedSettings(default_pool=PoolSettings(index=IndexConfig(speculative_ttl_s=5.0))))
    r = req("r", range(64))
    d = p.select(r, workers(0, 0), 0.0)
    assert d is not None
    p.on_dispatch(r, d, 0.0)
    again = p.select(req("r2", range(64)), workers(0, 0), 1.0)
    assert again is not None and again.worker == d.worker and again.reason == "hit"
    later = p.select(req("r3", range(64)), workers(0, 0), 100.0)
    assert later is not None and later.reason == "miss"
    assert p.stats().index["p"].speculative_entries == 0


def test_no_available_worker_gives_none() -> None:
    views = [
        WorkerView(WorkerId("w0"), healthy=False),
        WorkerView(WorkerId("w1"), max_in_flight=1, in_flight_requests=1),
    ]
    assert _policy().select(req("r", range(2)), views, 0.0) is None


@pytest.mark.parametrize("outcome", [Outcome.REJECTED, Outcome.ABORTED, Outcome.WORKER_FAILED])
def test_a_request_that_was_not_served_teaches_nothing(outcome: Outcome) -> None:
    p = _policy()
    r = req("r", range(64))
    d = p.select(r, workers(0, 0, 0, 0), 0.0)
    assert d is not None
    p.on_dispatch(r, d, 0.0)
    pool = p._pool(r)
    assert pool.cost.pending_requests == 1
    assert pool.index.lookup(r.block_keys, "t", 1.0).blocks(d.worker) == 64  # speculative
    p.on_complete(Observation(r, d.worker, ttft_s=0.5, prompt_tokens=r.n_prompt_tokens, outcome=outcome), 1.0)
    assert pool.index.lookup(r.block_keys, "t", 1.0).longest_blocks == 0
    assert pool.cost.pending_requests == 0 and pool.cost.calibration_samples == 0
    assert p.stats().counters["failed_observations"] == 1
    p.check_invariants()


def test_a_failure_keeps_what_an_earlier_served_request_confirmed() -> None:
    p = _policy(branch_load_weight=0.0)  # half the prompt matches: no branch charge steers it away
    _warm(p, range(32), "w1")
    r = req("r", range(64))
    d = p.select(r, workers(0, 0, 0, 0), 1.0)
    assert d is not None and d.worker == "w1"
    p.on_dispatch(r, d, 1.0)
    p.on_complete(Observation(r, d.worker, outcome=Outcome.REJECTED), 2.0)
    # The 32 confirmed blocks stay; the 32 guessed from the failed request are gone.
    assert p._pool(r).index.lookup(r.block_keys, "t", 2.0).blocks_by_worker == {WorkerId("w1"): 32}
    p.check_invariants()


def _reference_best_s(p: CostPolicy, r: RouteRequest, views: list[WorkerView]) -> float:
    """The best score by brute force: every eligible worker scored with the cost model's own
    functions (no inlining, no pruning)."""
    pool = p._pool(r)
    model = pool.cost
    loads = [load_of(v) for v in views]
    mean_after = (sum(loads) + 1) / len(views)
    bound = max((1 + p.epsilon) * mean_after, mean_after + p.slack_requests) - 1
    if min(loads) > bound:
        bound = float("inf")
    backlog = sum(v.in_flight_prefill_tokens for v in views)
    waiting = backlog / len(views) / max(1.0, model.mean_prompt_tokens)
    weight = 1 + p.work_weight * min(waiting, p.max_queue_factor)
    match = pool.index.lookup(r.block_keys, r.namespace, 5.0)
    branch = 2 * p._cap_tokens(r, match.longest_blocks) <= r.n_prompt_tokens
    best = -float("inf")
    for v, load in zip(views, loads, strict=True):
        matched = p._cap_tokens(r, match.blocks(v.worker_id))
        follow = 2 * matched > r.n_prompt_tokens and load <= bound + p.continuation_slack_requests
        if load > bound and not follow:
            continue
        score = model.saved_s(r.n_prompt_tokens, matched) * weight - model.queue_s(
            v, r.n_prompt_tokens - matched
        )
        if branch:  # most of the prompt is new: charge each worker its recent work
            score -= p.branch_load_weight * p.recent_work_s(v.worker_id, 5.0)
        best = max(best, score)
    return best


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, 60_000), st.integers(0, 200_000), st.integers(0, 5)),
        min_size=1,
        max_size=12,
    ),
    st.lists(st.integers(0, 64), min_size=1, max_size=12),
    st.sampled_from([0.0, 4.0]),
)
def test_pruned_scoring_finds_the_brute_force_best(
    loads: list[tuple[int, int, int, int]], depths: list[int], continuation_slack: float
) -> None:
    p = _policy(continuation_slack_requests=continuation_slack)
    views = [
        WorkerView(
            WorkerId(f"w{i}"),
            in_flight_requests=n,
            in_flight_prefill_tokens=pf,
            in_flight_decode_tokens=dc,
            num_requests_waiting=wt,
            num_requests_running=n,
        )
        for i, (n, pf, dc, wt) in enumerate(loads)
    ]
    for i, depth in enumerate(depths[: len(views)]):
        if depth:
            _warm(p, range(depth), f"w{i}")
    r = req("r", range(64))
    d = p.select(r, views, 5.0)
    assert d is not None
    assert d.score_s == pytest.approx(_reference_best_s(p, r, views), abs=2 * p.tie_s)


@pytest.mark.parametrize("discount", [True, False, "holders"])
def test_a_holder_busy_with_cached_prompts_is_not_taken_for_a_long_queue(discount: bool | str) -> None:
    p = _policy(discount_cached_backlog=discount)
    _warm(p, range(64), "w0")
    # Eight requests on the same prefix are in flight on w0: 8k prompt tokens, almost all cached.
    for i in range(8):
        r = req(f"f{i}", range(64))
        d = p.select(r, [WorkerView(WorkerId("w0"))], 1.0)
        assert d is not None and d.matched_tokens == 64 * BS
        p.on_dispatch(r, d, 1.0)
    assert p.uncached_share(WorkerId("w0")) == pytest.approx(1 / (64 * BS + 1))
    views = workers(8, 0, 0, 0, prefill=(8 * (64 * BS + 1), 0, 0, 0))
    d = p.select(req("r", range(64)), views, 1.0)
    assert d is not None
    # Counted as whole prompts the holder looks 0.2 s busy and the prefix is recomputed elsewhere;
    # counted as what is left to compute (every worker's, or the holders' only), it stays there.
    assert (d.worker == "w0") is (discount is not False)
    # Finishing (in any way) takes a request out of the ledger.
    for i in range(8):
        p.on_complete(Observation(req(f"f{i}", range(64)), WorkerId("w0"), outcome=Outcome.ABORTED), 2.0)
    assert p.uncached_share(WorkerId("w0")) == 1.0


@pytest.mark.parametrize("discount", [True, "holders"])
def test_only_holders_of_most_of_the_prompt_count_their_backlog_as_left_with_holders(
    discount: bool | str,
) -> None:
    p = _policy(discount_cached_backlog=discount, branch_load_weight=0.0)
    _warm(p, range(64), "w0")
    for i in range(8):  # w0: eight mostly-cached prompts in prefill
        r = req(f"f{i}", range(64))
        d = p.select(r, [WorkerView(WorkerId("w0"))], 1.0)
        assert d is not None
        p.on_dispatch(r, d, 1.0)
    # w1: six uncached prompts of the same size, sent by another gateway (not in this ledger).
    views = workers(8, 6, 0, 0, 0, 0, 0, 0, prefill=(8 * (64 * BS + 1), 6 * 64 * BS, *[10**6] * 6))
    d = p.select(req("m", range(5000, 5064)), views, 1.0)
    assert d is not None and d.reason == "miss"
    # A prompt nobody holds: with every backlog counted as left, w0's mostly-cached one is the
    # shortest; with the holders' only, w0's counts whole, longer than w1's.
    assert d.worker == ("w0" if discount is True else "w1")
    assert p.discounts_backlog("p") is (discount is True)


def test_new_branches_go_where_little_work_was_routed_recently() -> None:
    p = _policy(branch_load_weight=1.0, load_window_s=60.0)
    _warm(p, range(2000), "w0")  # about a second of prefill routed to w0 at t = 0
    assert p.recent_work_s(WorkerId("w0"), 0.0) > 0.5
    for i in range(6):
        d = p.select(req(f"n{i}", range(10_000 + i * 100, 10_000 + i * 100 + 8)), workers(0, 0, 0, 0), 1.0)
        assert d is not None and d.worker != "w0" and d.reason == "miss"
        p.on_dispatch(req(f"n{i}", range(8)), d, 1.0)
    # The charge fades with the window: ten windows later w0 is as good as any worker.
    assert p.recent_work_s(WorkerId("w0"), 600.0) < 1e-4


def test_engine_tokens_per_request_token_is_learned_from_usage() -> None:
    p = _policy()
    for i in range(200):
        r = req(f"u{i}", range(i * 10, i * 10 + 8))
        d = p.select(r, workers(0, 0), float(i))
        assert d is not None
        p.on_dispatch(r, d, float(i))
        # Approximate mode: the engine counted four tokens per estimated one.
        p.on_complete(
            Observation(r, d.worker, prompt_tokens=4 * r.n_prompt_tokens, cached_tokens=0), float(i)
        )
    model = p._pool(req("x", range(1))).cost
    assert model.engine_tokens_per_request_token == pytest.approx(4.0, rel=0.01)
    assert model.mean_prompt_tokens > 2 * (8 * BS + 1)  # in engine tokens, like the scaled backlog


def test_token_exact_keys_keep_a_unit_ratio() -> None:
    p = _policy()
    _warm(p, range(8), "w0")
    assert p._pool(req("x", range(1))).cost.engine_tokens_per_request_token == 1.0


def test_completion_confirms_what_its_dispatch_left_speculative_and_nothing_else() -> None:
    p = CostPolicy(seed=0)
    views = workers(0, 0)

    def dispatch(r: RouteRequest, now: float) -> WorkerId:
        d = p.select(r, views, now)
        assert d is not None
        p.on_dispatch(r, d, now)
        return d.worker

    index = p._pool(req("x", range(1))).index
    first = req("a", range(10))
    w = dispatch(first, 0.0)
    assert index.stats().speculative_entries == 10  # routing-only until the worker serves it
    p.on_complete(Observation(first, w, prompt_tokens=first.n_prompt_tokens), 0.5)
    assert index.stats().speculative_entries == 0
    # The same prefix again within the recency resolution: warm and confirmed, nothing to record.
    again = req("b", range(10))
    assert dispatch(again, 0.6) == w
    assert index.stats().speculative_entries == 0
    # A longer prompt on the same prefix: only its new blocks are speculative, then confirmed.
    longer = req("c", range(14))
    assert dispatch(longer, 0.7) == w
    assert index.stats().speculative_entries == 4
    p.on_complete(Observation(longer, w, prompt_tokens=longer.n_prompt_tokens), 0.8)
    p.on_complete(Observation(again, w, prompt_tokens=again.n_prompt_tokens), 0.9)
    assert index.stats().speculative_entries == 0
    assert index.lookup(longer.block_keys, "t", 1.0).blocks(w) == 14
    p.check_invariants()


def test_a_request_estimated_at_zero_tokens_completes_cleanly() -> None:
    # A completions prompt of "hi" is estimated at 0 tokens: its dispatch leaves nothing in the
    # per-worker sums, and finishing it must not look them up.
    p = _policy()
    r = req("tiny", [], extra_tokens=0)
    d = p.select(r, workers(0, 0), 0.0)
    assert d is not None
    p.on_dispatch(r, d, 0.0)
    p.on_complete(Observation(r, d.worker, prompt_tokens=1, completion_tokens=4), 0.1)
    assert p.uncached_share(d.worker) == 1.0
    p.check_invariants()
