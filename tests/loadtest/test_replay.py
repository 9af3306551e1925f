"""`kvgate bench replay`: a run compared with itself agrees everywhere; a forced placement is
followed and its divergence explained by the signals that differ."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.cli import main
from loadtest.bench_routing import warmup_request
from loadtest.replay.cli import _stream, simulate
from loadtest.replay.compare import compare, render
from loadtest.replay.forced import ForcedPolicy, SimDecision
from loadtest.replay.log import Candidate, HttpDecision, read_decisions
from loadtest.workloads.registry import make_workload
from policies import make_policy

CONFIG: dict[str, Any] = {"seed": 0, "workers": 3, "kv_blocks": 1500, "model": "emulated-llama"}


_GSP = ["num_groups=4", "prompts_per_group=6", "output_len=8", "rate_per_s=16"]


def _gsp() -> list[Any]:
    return make_workload("gsp", 0, _GSP)


def _as_http(d: SimDecision) -> HttpDecision:
    candidates = tuple(
        Candidate(
            w,
            d.predicted.get(w, 0),
            v.in_flight_requests,
            v.in_flight_prefill_tokens,
            v.in_flight_decode_tokens,
            v.num_requests_waiting,
            v.num_requests_running,
        )
        for w, v in d.views.items()
    )
    assert d.worker is not None
    return HttpDecision(d.request_id, d.t_s, d.worker, d.reason, 0, candidates, d.n_prompt_tokens, 1, 0, 1.0)


def test_a_simulated_run_replayed_against_itself_agrees_on_every_decision() -> None:
    reqs = _gsp()
    free = ForcedPolicy(make_policy("cost"), None)
    simulate(reqs, CONFIG, free, 1.0)
    http = {rid: _as_http(d) for rid, d in free.decisions.items()}
    forced = ForcedPolicy(make_policy("cost"), {rid: d.worker for rid, d in http.items()})
    simulate(reqs, CONFIG, forced, 1.0)
    agreement = compare(http, forced.decisions)
    assert agreement.n == len(reqs) and agreement.ratio == 1.0
    assert "agreement 100.0%" in render(agreement)


def test_a_forced_placement_is_followed_and_its_divergence_names_the_signals() -> None:
    reqs = _gsp()
    free = ForcedPolicy(make_policy("cost"), None)
    simulate(reqs, CONFIG, free, 1.0)
    ordered = sorted(free.decisions.values(), key=lambda d: d.t_s)
    hit = next(d for d in ordered if d.reason == "hit")  # a request on its prefix's worker
    second, chosen = hit.request_id, hit.worker
    other = next(w for w in ("w0", "w1", "w2") if w != chosen)
    http = {rid: _as_http(d) for rid, d in free.decisions.items()}
    http[second] = HttpDecision(second, hit.t_s, other, "spread", 0, (), 1, 1, 0, 1.0)
    forced = ForcedPolicy(make_policy("cost"), {rid: d.worker for rid, d in http.items()})
    simulate(reqs, CONFIG, forced, 1.0)
    agreement = compare(http, forced.decisions)
    assert agreement.same < agreement.n
    assert agreement.divergences[0].request_id == second
    assert "predicted" in agreement.divergences[0].signals


def test_the_log_reader_renames_workers_and_skips_the_warm_up(tmp_path: Path) -> None:
    def line(rid: str, worker: str) -> bytes:
        cand = {"worker": worker, "predicted_cached_tokens": 0, "in_flight": 0, "prefill_tokens": 0}
        other = {**cand, "worker": "http://b" if worker == "http://a" else "http://a"}
        decision = {"t_s": 0.5, "worker": worker, "reason": "miss", "predicted_cached_tokens": 0}
        decision["candidates"] = [cand, other]
        record = {"client_request_id": rid, "n_prompt_tokens": 5, "decisions": [decision]}
        return orjson.dumps({**record, "prompt_tokens": 20, "cached_tokens": 0, "ttft_ms": 1.0})

    path = tmp_path / "decisions.jsonl"
    path.write_bytes(b"\n".join([line("warmup-0", "http://a"), line("r1", "http://b")]))
    decisions, workers = read_decisions(path)
    assert workers == ["http://a", "http://b"]
    assert list(decisions) == ["r1"] and decisions["r1"].worker == "w1"


def test_the_warm_up_is_replayed_first_and_left_out_of_the_comparison() -> None:
    config = {**CONFIG, "workload": "gsp", "workload_args": _GSP, "n_requests": 24, "max_requests": 24}
    reqs = make_workload("gsp", 0, _GSP)

    def decided(rid: str, t_s: float) -> HttpDecision:
        return HttpDecision(rid, t_s, "w0", "miss", 0, (), 1, 1, 0, 1.0)

    http = {r.request_id: decided(r.request_id, 1.0 + r.arrival_s) for r in reqs}
    warm = {"warmup-0": decided("warmup-0", 0.0), "warmup-1": decided("warmup-1", 0.1)}
    stream = _stream(config, http, warm, "http")
    assert [r.request_id for r in stream[:2]] == ["warmup-0", "warmup-1"]
    assert stream[1].arrival_s == 0.1 and stream[2].arrival_s == 1.0 + min(r.arrival_s for r in reqs)
    assert stream[0] == dataclasses.replace(warmup_request(0, reqs[0].tenant), arrival_s=0.0)
    assert len(stream) == len(reqs) + 2
    forced = ForcedPolicy(make_policy("cost"), {**{rid: "w0" for rid in warm}, **{r: "w0" for r in http}})
    simulate(stream, config, forced, 1.0)
    assert "warmup-0" in forced.decisions and compare(http, forced.decisions).n == len(reqs)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_conversation_trace_run_over_http_is_replayed_decision_by_decision(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["bench", "routing", "--trace", "mooncake-conversation", "--rate-scale", "8", "--workers", "2"]
    args += ["--max-requests", "6", "--kv-blocks", "4000", "--routers", "kvgate:cost", "--decision-log"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    assert main(["bench", "replay", "--run", str(out), "--json", str(tmp_path / "replay.json")]) == 0
    doc = orjson.loads((tmp_path / "replay.json").read_bytes())
    assert doc["n"] == 6 and 0 < doc["agreement"] <= 1
