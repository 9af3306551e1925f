from __future__ import annotations

import pytest

from loadtest.engine import load_profile
from loadtest.goodput.config import PolicyEntry, TraceSpec
from loadtest.goodput.runner import (
    SimSettings,
    TraceSetup,
    count_met,
    prepare_trace,
    run_point,
    slice_requests,
)
from loadtest.simulator.records import RequestRecord
from loadtest.workloads.registry import make_workload

SIM = SimSettings(workers=2, seed=0, scrape_interval_s=1.0)


def _setup(ttft_slo_s: float = 0.3, tpot_slo_s: float = 0.05) -> TraceSetup:
    reqs = make_workload(
        "gsp",
        0,
        ["num_groups=4", "prompts_per_group=6", "system_prompt_len=1024", "output_len=16", "rate_per_s=4"],
    )
    spec = TraceSpec(ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)
    return prepare_trace("gsp", spec, load_profile("llama3-8b-h100"), seed=0, requests=reqs)


def _record(rid: str, ttft: float | None, tpot: float | None, worker: str | None = "w0") -> RequestRecord:
    return RequestRecord(rid, "t", "", worker, 0.0, ttft, ttft, ttft, tpot, ttft, 10, 0, 2, 0, "r")


def test_count_met_needs_both_slos_and_a_first_token() -> None:
    records = [
        _record("ok", 0.2, 0.04),
        _record("one-token answer", 0.2, None),
        _record("slow first token", 0.31, 0.01),
        _record("slow decode", 0.1, 0.06),
        _record("refused", None, None, worker=None),
        _record("exactly at the objectives", 0.3, 0.05),
    ]
    assert count_met(records, 0.3, 0.05) == 3


def test_slices_keep_the_window_then_the_first_requests() -> None:
    reqs = make_workload("gsp", 0, ["num_groups=2", "prompts_per_group=10", "rate_per_s=2"])
    first = min(r.arrival_s for r in reqs)
    window = slice_requests(reqs, max_requests=None, window_s=3.0)
    assert window and all(r.arrival_s < first + 3.0 for r in window)
    assert len(window) < len(reqs)
    assert slice_requests(reqs, max_requests=5, window_s=None) == sorted(reqs, key=lambda r: r.arrival_s)[:5]


def test_attainment_falls_when_the_same_requests_arrive_faster() -> None:
    setup = _setup(ttft_slo_s=0.1)
    slow = run_point(setup, "round_robin", 0.5, SIM)
    fast = run_point(setup, "round_robin", 64.0, SIM)
    assert slow.complete and fast.complete and slow.n_requests == fast.n_requests == 24
    assert slow.attainment == 1.0
    assert fast.attainment < slow.attainment
    assert (fast.ttft_p99_s or 0.0) > (slow.ttft_p99_s or 0.0) > 0.0
    assert (fast.utilization or 0.0) > (slow.utilization or 0.0) > 0.0


@pytest.mark.parametrize("policy", ["round_robin", "cost"])
def test_the_watch_changes_no_decision(policy: str) -> None:
    setup = _setup()
    plain = run_point(setup, policy, 8.0, SIM)
    watched = run_point(setup, policy, 8.0, SIM, stop_below_share=0.01)
    assert watched.complete
    assert (watched.n_met, watched.hit_ratio, watched.ttft_p99_s, watched.tpot_p99_s) == (
        plain.n_met,
        plain.hit_ratio,
        plain.ttft_p99_s,
        plain.tpot_p99_s,
    )


def test_a_hopeless_point_stops_as_soon_as_the_share_is_out_of_reach() -> None:
    setup = _setup(ttft_slo_s=1e-6)  # no request can meet it
    stopped = run_point(setup, "cost", 1.0, SIM, stop_below_share=0.9)
    assert not stopped.complete and not stopped.passes(0.9)
    # 24 requests at a 90 % share allow 2 misses; the third ends the replay.
    assert stopped.n_met == 24 - 3 and stopped.attainment == pytest.approx(21 / 24)
    assert stopped.ttft_p99_s is None
    full = run_point(setup, "cost", 1.0, SIM)
    assert full.complete and full.attainment == 0.0


@pytest.mark.parametrize(
    "entry", [PolicyEntry(policy="cost", pd="1:1"), PolicyEntry(policy="round_robin", pd="1:1")]
)
def test_a_pd_row_runs_split_and_the_watch_changes_no_decision(entry: PolicyEntry) -> None:
    setup = _setup()
    mixed = run_point(setup, entry.policy, 8.0, SIM)
    plain = run_point(setup, entry, 8.0, SIM)
    watched = run_point(setup, entry, 8.0, SIM, stop_below_share=0.01)
    assert plain.complete and plain.n_requests == 24
    assert (plain.ttft_p99_s, plain.tpot_p99_s) != (mixed.ttft_p99_s, mixed.tpot_p99_s)
    assert watched.complete
    assert (watched.n_met, watched.hit_ratio, watched.ttft_p99_s, watched.tpot_p99_s) == (
        plain.n_met,
        plain.hit_ratio,
        plain.ttft_p99_s,
        plain.tpot_p99_s,
    )


def test_the_watch_counts_a_request_heard_of_twice_once() -> None:
    from loadtest.goodput.watch import PointHopeless, watch_policy
    from policies.base import Observation, RouteRequest, WorkerId
    from policies.cost_policy import CostPolicy
    from policies.pd import MovesKvAware, PrefixHolder
    from policies.registry import make_policy

    cost = make_policy("cost", seed=0)
    watch = watch_policy(cost, {"a": 0.0, "b": 0.0}, ttft_slo_s=0.1, tpot_slo_s=0.1, share=0.5, pd=True)
    assert isinstance(watch, PrefixHolder), "P/D routing still sees what the policy holds"
    # ... and still tells it of a pool that moves KV (holder_prefill), which changes its scoring.
    assert isinstance(watch, MovesKvAware) and isinstance(cost, CostPolicy)
    watch.pool_moves_kv("p")
    assert cost.discounts_backlog("p")
    assert not isinstance(watch_policy(make_policy("round_robin"), {}, ttft_slo_s=1, tpot_slo_s=1, share=1),
                          PrefixHolder)  # fmt: skip
    a = RouteRequest("a", "p", "t", "ns", (), 100, 16)
    watch.on_complete(Observation(a, WorkerId("w0"), ttft_s=0.5, completion_tokens=1), 0.5)  # prefill leg
    watch.on_complete(Observation(a, WorkerId("w1"), ttft_s=0.6, completion_tokens=4), 0.9)  # answer
    assert watch.n_missed == 1  # two requests at a 50 % share allow one miss: not stopped yet
    b = RouteRequest("b", "p", "t", "ns", (), 100, 16)
    with pytest.raises(PointHopeless):
        watch.on_complete(Observation(b, WorkerId("w0"), ttft_s=0.5, completion_tokens=1), 0.5)


def test_a_row_with_settings_runs_its_policy_as_a_policy_file_sets_it() -> None:
    setup = _setup()
    # An index with room for almost nothing forgets every system prompt: cost loses its hits.
    tiny = PolicyEntry(
        name="cost, tiny index", policy="cost", settings={"default_pool": {"capacity_fraction": 0.001}}
    )
    plain, small = run_point(setup, "cost", 1.0, SIM), run_point(setup, tiny, 1.0, SIM)
    assert plain.hit_ratio is not None and small.hit_ratio is not None
    assert small.hit_ratio < plain.hit_ratio
    for bad in ({"seed": 3}, {"policy": "round_robin"}, {"cost": {"no_such_knob": 1}}):
        with pytest.raises(ValueError, match="settings"):
            PolicyEntry(policy="cost", settings=bad)


def test_an_objective_row_gives_cost_the_traces_ttft_slo() -> None:
    row = PolicyEntry(policy="cost", objective=True, settings={"cost": {"epsilon": 0.25}})
    config = row.policy_config(4, 1.4)
    assert config is not None and config.seed == 4
    assert config.cost.ttft_objective_s == 1.4 and config.cost.epsilon == 0.25
    assert PolicyEntry(policy="cost").policy_config(0, 1.4) is None
    for bad in (
        {"policy": "preble_e2", "objective": True},
        {"policy": "cost", "objective": True, "settings": {"cost": {"ttft_objective_s": 2.0}}},
    ):
        with pytest.raises(ValueError, match="objective"):
            PolicyEntry.model_validate(bad)
