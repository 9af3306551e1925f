"""Several gateways in the simulator: the balancer, the sync bus, and what sync buys."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from gateway.cli import main
from loadtest.simulator.cli import spread_arrivals
from loadtest.simulator.gateways import SimGateway, SyncBus, pick_gateway
from loadtest.workloads.records import TextPrompt, WorkloadRequest
from policies.base import RouteDecision, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from policies.registry import make_policy
from tests.policies.factories import req

# Three workers with room for about one group's system prompt each, several groups: the gateways'
# placements matter, and a gateway that learns alone misses prefixes its peers placed.
GSP = [
    "--workload", "gsp", "--workload-arg", "num_groups=6", "--workload-arg", "prompts_per_group=12",
    "--workload-arg", "system_prompt_len=2048", "--workload-arg", "output_len=8",
    "--workload-arg", "rate_per_s=8", "--workers", "3", "--quiet", "--policy", "cost",
]  # fmt: skip


def _summary(tmp_path: Path, *extra: str) -> tuple[dict[str, object], dict[str, object]]:
    out = tmp_path / "sim.json"
    assert main(["simulate", *GSP, "--json", str(out), *extra]) == 0
    doc = json.loads(out.read_text())
    return doc["summary"], doc["config"]


def test_the_balancer_spreads_requests_by_a_seeded_hash_of_the_request() -> None:
    ids = [f"s{s}-t{t}" for s in range(50) for t in range(8)]
    picks = [pick_gateway(i, 4, 0) for i in ids]
    assert picks == [pick_gateway(i, 4, 0) for i in ids]
    assert min(Counter(picks).values()) > 60  # about 100 each
    assert picks != [pick_gateway(i, 4, 1) for i in ids]
    # A session's turns do not stick to one gateway.
    assert len({pick_gateway(f"s0-t{t}", 4, 0) for t in range(8)}) > 1
    assert {pick_gateway(i, 1, 3) for i in ids} == {0}


def test_the_bus_delivers_to_every_other_gateway_after_the_delay() -> None:
    gws = [SimGateway(i, make_policy("cost", seed=i), 2) for i in range(3)]
    bus = SyncBus(gws, delay_s=0.05)
    r = req("r", range(8))
    gws[0].policy.on_dispatch(r, RouteDecision(WorkerId("w1"), 0.0, "miss"), 1.0)
    gws[0].in_flight[1] = 1
    bus.load_changed(gws[0], "p", WorkerId("w1"), 1, 1.0)
    assert bus.next_due_s == 1.05
    bus.deliver_due(1.04)
    assert gws[1].peer_loads is not None and not gws[1].peer_loads.any
    bus.deliver_due(1.05)
    assert bus.published == 2 and bus.delivered == 4 and not bus.queue
    for gw in gws[1:]:
        policy = gw.policy
        assert isinstance(policy, CostPolicy) and policy.stats().counters["peer_holdings_applied"] == 1
        view = gw.fold("p", WorkerView(WorkerId("w1"), in_flight_requests=2))
        assert view.in_flight_requests == 3
    # The origin learns nothing from itself.
    assert "peer_holdings_applied" not in gws[0].policy.stats().counters  # type: ignore[attr-defined]
    assert gws[0].fold("p", WorkerView(WorkerId("w1"))).in_flight_requests == 0


def test_sync_recovers_what_independent_gateways_lose(tmp_path: Path) -> None:
    one, _ = _summary(tmp_path)
    alone, _ = _summary(tmp_path, "--gateways", "4", "--sync", "none")
    synced, config = _summary(tmp_path, "--gateways", "4", "--sync", "broker", "--sync-delay-ms", "5")
    assert config["gateways"] == 4 and config["sync"] == "broker" and config["sync_delay_ms"] == 5
    assert isinstance(one["hit_ratio"], float) and isinstance(alone["hit_ratio"], float)
    assert isinstance(synced["hit_ratio"], float)
    assert alone["hit_ratio"] < one["hit_ratio"] - 0.02
    assert synced["hit_ratio"] > alone["hit_ratio"] + 0.02
    assert synced["sync_items_published"] != 0 and alone["sync_items_published"] == 0
    counters = synced["policy_counters"]
    assert isinstance(counters, dict) and counters["peer_holdings_applied"] > 0


def test_one_gateway_with_a_broker_is_one_gateway(tmp_path: Path) -> None:
    plain, _ = _summary(tmp_path)
    lone, _ = _summary(tmp_path, "--sync", "broker")
    for s in (plain, lone):
        s.pop("wall_time_s")
    assert lone.pop("sync_items_published") > plain.pop("sync_items_published") == 0  # type: ignore[operator]
    assert plain == lone


def test_arrivals_spread_within_a_window_by_request_id() -> None:
    reqs = [WorkloadRequest(f"r{i}", 3.0, "t", "", TextPrompt("x"), 1) for i in range(50)]
    out = spread_arrivals(reqs, 2.0, seed=0)
    times = [r.arrival_s for r in out]
    assert times == sorted(times) and all(3.0 <= t < 5.0 for t in times) and len(set(times)) == 50
    again = {r.request_id: r.arrival_s for r in spread_arrivals(reqs[::-1], 2.0, seed=0)}
    assert again == {r.request_id: r.arrival_s for r in out}  # the request alone decides its draw


LONG_PROMPT = 24_000


def _burst_trace(path: Path) -> None:
    """Every 7 s, one long new prompt and then five short ones, all at the same instant (as a trace
    on a coarse clock has them)."""
    rows = []
    block = 0
    for k in range(30):
        for size in (LONG_PROMPT, 1000, 1000, 1000, 1000, 1000):
            n_blocks = -(-size // 512)
            rows.append(
                {"timestamp": 7000 * k, "input_length": size, "output_length": 8,
                 "hash_ids": list(range(block, block + n_blocks))}
            )  # fmt: skip
            block += n_blocks
    path.write_text("\n".join(json.dumps(r) for r in rows))


def test_held_long_prompts_let_the_short_ones_of_the_instant_go_first(tmp_path: Path) -> None:
    trace = tmp_path / "bursts.jsonl"
    _burst_trace(trace)
    waits = {}
    for steps in (0, 3):
        cfg = tmp_path / f"policy{steps}.yaml"
        cfg.write_text(f"policy: cost\ncost:\n  herd_hold_steps: {steps}\n")
        out = tmp_path / f"sim{steps}.json"
        argv = ["simulate", "--trace", str(trace), "--workers", "4", "--gateways", "4", "--sync", "broker"]
        assert main([*argv, "--policy-config", str(cfg), "--quiet", "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        holds = doc["summary"]["policy_counters"].get("herd_holds", 0)
        assert (holds > 0) == (steps > 0)
        short = [r for r in doc["requests"] if r["prompt_tokens"] < LONG_PROMPT]
        assert len(short) == 150
        # How many short prompts waited for a long one's prefill (about a second here).
        waits[steps] = sum(r["ttft_s"] > 0.5 for r in short)
    # Without holds, a short prompt another gateway placed the same instant on the long prompt's
    # worker waits for its whole prefill; with them the long prompt is placed after, seeing it.
    assert waits[0] >= 8
    assert waits[3] == 0
