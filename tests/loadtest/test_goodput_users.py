"""`kvgate bench goodput` with `load: users`: a closed-loop trace's capacity searched in users."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from loadtest.goodput.config import GoodputConfigError, parse_goodput_yaml


def _agent_trace(path: Path, turns: int = 12, api_time: float = 1.0) -> Path:
    """One kv-cache-tester session: a 2k-token system prefix, each turn 1k tokens longer than the
    last, answered in 24 tokens, sent 2 s after the previous one."""
    block = 64
    rows = []
    for i in range(turns):
        n = 2048 + 1024 * i
        ids = list(range(n // block))
        rows.append({"t": 2.0 * i, "type": "n", "in": n, "out": 24, "hash_ids": ids, "api_time": api_time})
    doc = {
        "id": "s1",
        "block_size": block,
        "hash_id_scope": "local",
        "tool_tokens": 1500,
        "system_tokens": 500,
        "requests": rows,
    }
    path.write_text(json.dumps(doc))
    return path


def _config(tmp_path: Path, **trace: object) -> Path:
    entry = {
        "ttft_slo_s": 0.25,
        "tpot_slo_s": 0.05,
        "closed_loop": True,
        "load": "users",
        "users": 4,
        "user_spread_s": 4.0,
        "min_users": 1,
        "max_users": 256,
        "reference_rate_scale": 1.0,
        **trace,
    }
    cfg = {
        "policies": ["round_robin", "cost"],
        "baselines": ["round_robin"],
        "workers": 2,
        "traces": {str(_agent_trace(tmp_path / "agent.json")): entry},
    }
    path = tmp_path / "goodput.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_capacity_is_found_in_whole_users(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    assert main(["bench", "goodput", "--config", str(_config(tmp_path)), "--out", str(out_dir)]) == 0
    captured = capsys.readouterr()
    assert "goodput capacity (users, closed loop at 1×)" in captured.out
    doc = json.loads((out_dir / "goodput.json").read_text())
    (trace,) = doc["traces"].values()
    for policy in ("round_robin", "cost"):
        cap = trace["capacities"][policy]
        assert cap["load"] is not None and cap["failing_load"] is not None, cap
        assert cap["load"] == int(cap["load"]) and cap["failing_load"] == int(cap["failing_load"])
        assert cap["failing_load"] <= max(cap["load"] * 1.05, cap["load"] + 1)
        points = {p["users"]: p for p in trace["points"][policy]}
        # Each point replays the trace as that many users, at the reference rate: the users are
        # the load, and more of them send more requests.
        assert all(p["rate_scale"] == 1.0 for p in points.values())
        passing, failing = points[cap["load"]], points[cap["failing_load"]]
        assert passing["complete"] and passing["attainment"] >= 0.9
        assert failing["attainment"] < 0.9
        assert passing["n_requests"] == 12 * cap["load"]
        assert points[4]["complete"], "the starting user count is always replayed in full"
    assert "users" in captured.err, "each point's line names its users"


def test_a_resumed_users_search_simulates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "goodput", "--config", str(_config(tmp_path)), "--out", str(tmp_path / "out")]
    assert main([*args, "--quiet"]) == 0
    first = capsys.readouterr().out
    assert main([*args, "--resume"]) == 0
    second = capsys.readouterr()
    assert "attainment" not in second.err, "no point was simulated"
    assert first.split("wrote")[0] == second.out.split("wrote")[0]


@pytest.mark.parametrize(
    ("trace", "message"),
    [
        ({"closed_loop": False}, "load: users needs closed_loop: true"),
        ({"users": 300}, "need min_users <= users <= max_users"),
        ({"load": "requests"}, "load"),
        ({"max_requests": 100}, "no max_requests or window_s"),
        ({"window_s": 600.0}, "no max_requests or window_s"),
    ],
)
def test_a_users_search_needs_a_closed_loop_and_a_start_within_its_bounds(
    tmp_path: Path, trace: dict[str, object], message: str
) -> None:
    text = _config(tmp_path, **trace).read_text()
    with pytest.raises(GoodputConfigError, match=message):
        parse_goodput_yaml(text)


def test_the_shipped_closed_loop_config_searches_the_agent_trace_in_users() -> None:
    from loadtest.goodput.config import load_goodput_config

    closed, default = load_goodput_config("closed"), load_goodput_config(None)
    (spec,) = closed.traces.values()
    assert spec.by_users and spec.closed_loop and spec.trace == "kvct-agent"
    agent = default.traces["kvct-agent"]
    same = ("ttft_slo_s", "tpot_slo_s", "kv_blocks_per_worker", "user_spread_s")
    assert {k: getattr(spec, k) for k in same} == {k: getattr(agent, k) for k in same}
    assert "preble_e2" in closed.labels() and closed.subject == "cost"


def test_a_users_search_refuses_a_slice_of_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(_config(tmp_path))
    assert main(["bench", "goodput", "--config", config, "--max-requests", "50"]) == 2
    assert "load: users replays whole users" in capsys.readouterr().err


def test_a_closed_loop_point_stopped_early_judges_each_turn_from_when_it_was_sent(tmp_path: Path) -> None:
    """Closed loop, a turn is sent after the answers it follows: here, answered in 0.01 s in the
    recording, later than the trace's times. Its TPOT counts from its own first token; judged
    from the trace's arrival, every turn after the first would miss it and the point stop."""
    from loadtest.engine import load_profile
    from loadtest.goodput.config import TraceSpec
    from loadtest.goodput.runner import SimSettings, prepare_trace, run_point

    trace = _agent_trace(tmp_path / "agent.json", api_time=0.01)
    spec = TraceSpec(ttft_slo_s=5.0, tpot_slo_s=0.05, closed_loop=True, users=4, user_spread_s=4.0)
    setup = prepare_trace(str(trace), spec, load_profile("llama3-8b-h100"), seed=0)
    sim = SimSettings(workers=2, seed=0, scrape_interval_s=1.0)
    full = run_point(setup, "round_robin", 1.0, sim)
    watched = run_point(setup, "round_robin", 1.0, sim, stop_below_share=0.9)
    assert full.attainment >= 0.9, "the point passes"
    assert watched.complete and watched.n_met == full.n_met
