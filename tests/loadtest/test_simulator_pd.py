"""Prefill/decode disaggregation in the simulator, on the real engine model: a split request is
prefilled on its prefill worker, its KV moves in the profile's transfer time, and its decode
worker (which keeps what it received) answers; the gateway's pair chooser decides, so a prompt
the decode worker already holds runs there alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from loadtest.engine import Engine, EngineConfig, EngineRequest, load_profile
from loadtest.engine.hashing import block_hashes
from loadtest.simulator.loop import EngineHooks, LoopConfig, LoopResult, run_loop
from loadtest.simulator.pd import PdSim
from loadtest.workloads.records import BlockPrompt, WorkloadRequest
from policies.base import Role, RoutingPolicy
from policies.cost_policy import CostPolicy
from policies.pd import (
    ALONE_POLICY,
    ALONE_SOONER,
    HOLDER_PREFILL,
    PAIRS,
    SPLIT,
    VLLM_ROLES,
    PdRouter,
    PdSettings,
)
from policies.registry import make_policy
from tests.loadtest.test_simulator_cli import SMALL_GSP
from tests.loadtest.test_simulator_loop import Spy

PROFILE = load_profile("llama3-8b-h100")
BS = 16


def _request(rid: str, at_s: float, blocks: range, out: int = 8) -> WorkloadRequest:
    return WorkloadRequest(rid, at_s, "t", "s", BlockPrompt(tuple(blocks), BS, len(blocks) * BS), out)


def _pd(split: tuple[int, int] = (1, 1), conditional: bool = True) -> PdSim:
    """A P/D pool of `split` prefill and decode workers; (0, 0): mixed workers, holder_prefill."""
    settings = PdSettings(
        roles=VLLM_ROLES,
        transfer_setup_s=PROFILE.kv_transfer_setup_ms / 1000,
        transfer_bytes_per_token=PROFILE.kv_bytes_per_token,
        transfer_bandwidth_bytes_per_s=PROFILE.kv_transfer_bytes_per_s,
        conditional=conditional,
        mode=HOLDER_PREFILL if split[0] == 0 else PAIRS,
    )

    def make(rid: str, n: int, out: int, hashes: Any, external: int) -> EngineRequest:
        return EngineRequest(rid, n, out, hashes, external)

    return PdSim(PdRouter(settings), split[0], PROFILE.kv_transfer_s, make)


def _run(
    reqs: list[WorkloadRequest], policy: RoutingPolicy, pd: PdSim | None, n_workers: int = 2
) -> tuple[LoopResult, list[Engine]]:
    engines = [Engine(PROFILE, EngineConfig(kv_blocks=4000)) for _ in range(n_workers)]

    def make(rid: str, n: int, out: int, hashes: Any) -> EngineRequest:
        return EngineRequest(rid, n, out, hashes)

    def hash_tokens(tokens: Any, size: int, salt: str | None) -> list[int]:
        return block_hashes(tokens, size, salt, 0)

    hooks = EngineHooks(make, hash_tokens)
    return run_loop(reqs, engines, policy, hooks, LoopConfig(kv_events=True, pd=pd)), engines


def test_a_split_request_is_prefilled_moved_and_decoded_on_its_decode_worker() -> None:
    spy = Spy(make_policy("round_robin"))
    pd = _pd()
    (res, engines) = _run([_request("r0", 0.0, range(256))], spy, pd)
    [record] = res.requests
    n = 256 * BS
    assert record.worker == "w1" and record.output_tokens == 8 and record.cached_tokens == 0
    assert pd.counters.splits == 1 and pd.counters.transferred_tokens == n
    # Alone on one worker the first token takes the prefill; split it takes the prefill, the
    # transfer and the decode worker's first step.
    alone, _ = _run([_request("r0", 0.0, range(256))], make_policy("round_robin"), None, 1)
    assert record.ttft_s is not None and alone.requests[0].ttft_s is not None
    assert record.ttft_s > alone.requests[0].ttft_s + PROFILE.kv_transfer_s(n)
    # The policy heard of both legs, the prefill worker's first.
    assert spy.dispatched == ["r0", "r0"]
    assert [str(o.worker) for o in spy.completed] == ["w0", "w1"]
    assert spy.completed[0].completion_tokens == 1 and spy.completed[1].completion_tokens == 8
    # Both hold the prompt now: the prefill worker computed it, the decode worker installed it, and
    # both said so in KV events (the same chain: the engines share their hash seed).
    stored = [h for e in spy.events if e.kind == "block_stored" for h in e.block_hashes]
    assert len(stored) >= 2 * 256 and len(set(stored)) < len(stored)
    assert all(e.stats().num_running == 0 for e in engines)


def test_a_turn_cached_on_the_decode_worker_skips_a_busy_prefill_queue() -> None:
    pd = _pd()
    burst = [_request(f"b{i}", 4.99, range(10_000 * (i + 1), 10_000 * (i + 1) + 256)) for i in range(3)]
    reqs = [_request("t1", 0.0, range(256)), *burst, _request("t2", 5.0, range(260))]
    res, _ = _run(reqs, CostPolicy(), pd)
    by_id = {r.request_id: r for r in res.requests}
    # The burst's long new prompts queue on the prefill worker; the next turn, whose prefix the
    # decode worker holds (it installed it), runs there alone and its hit is the decode worker's.
    assert by_id["t1"].reason == SPLIT and by_id["b0"].reason == SPLIT
    assert by_id["t2"].reason == ALONE_SOONER and by_id["t2"].worker == "w1"
    assert by_id["t2"].cached_tokens == 256 * BS
    assert pd.counters.splits + pd.counters.alone[ALONE_SOONER] == 5
    assert by_id["t2"].ttft_s is not None and by_id["b1"].ttft_s is not None
    assert by_id["t2"].ttft_s < by_id["b1"].ttft_s


def test_without_conditional_disaggregation_the_next_turn_moves_only_what_is_new() -> None:
    pd = _pd(conditional=False)
    reqs = [_request("t1", 0.0, range(256)), _request("t2", 5.0, range(260))]
    res, _ = _run(reqs, CostPolicy(), pd)
    assert pd.counters.splits == 2 and pd.counters.alone == {}
    # The second prefill hit the prefill worker's cache; only 4 new blocks moved.
    assert pd.counters.transferred_tokens == 256 * BS + 4 * BS
    assert {r.request_id: r.cached_tokens for r in res.requests}["t2"] == 256 * BS


def test_a_busy_pool_is_deterministic_and_serves_everything() -> None:
    reqs = [_request(f"r{i}", i * 0.01, range(1000 * i, 1000 * i + 64 + 8 * (i % 5)), 32) for i in range(40)]

    def once() -> list[Any]:
        res, engines = _run(reqs, CostPolicy(), _pd((2, 2)), 4)
        assert all(e.stats().num_running == 0 and e.stats().num_waiting == 0 for e in engines)
        return sorted((r.request_id, r.worker, r.ttft_s, r.tpot_s, r.cached_tokens) for r in res.requests)

    first = once()
    assert len(first) == 40 and all(w in ("w2", "w3") for _, w, *_ in first)
    assert first == once()


def test_a_turn_moved_off_its_busy_holder_is_prefilled_there_in_holder_prefill_mode() -> None:
    # `cost` with a guard that admits no worker above the mean: while the first turn's long
    # answer decodes on its worker, the next turn is sent to the other one.
    reqs = [
        _request("t1", 0.0, range(256)),
        _request("long", 1.0, range(258), 3000),
        _request("t2", 2.0, range(260)),
    ]
    pd = _pd((0, 0))
    res, engines = _run(reqs, CostPolicy(epsilon=0.0, slack_requests=0.0), pd)
    by_id = {r.request_id: r for r in res.requests}
    holder = by_id["t1"].worker
    assert by_id["long"].worker == holder
    # The holder computes the 4 new blocks, the other worker receives the prompt and decodes.
    t2 = by_id["t2"]
    assert t2.reason == SPLIT and t2.worker != holder and t2.cached_tokens == 258 * BS
    assert pd.counters.splits == 1 and pd.counters.transferred_tokens == 260 * BS
    assert pd.counters.alone == {ALONE_POLICY: 2}
    # The same pool without the mode computes the whole prompt again there, later.
    plain, _ = _run(reqs, CostPolicy(epsilon=0.0, slack_requests=0.0), None)
    again = {r.request_id: r for r in plain.requests}["t2"]
    assert again.worker != holder and again.cached_tokens == 0
    assert t2.ttft_s is not None and again.ttft_s is not None and t2.ttft_s < again.ttft_s
    assert all(e.stats().num_running == 0 for e in engines)


def test_the_policy_is_asked_about_prefill_workers_only() -> None:
    spy = Spy(make_policy("round_robin"))
    _run([_request("r0", 0.0, range(8))], spy, _pd((2, 1)), 3)
    assert [(str(v.worker_id), v.role) for v in spy.views[0]] == [("w0", Role.PREFILL), ("w1", Role.PREFILL)]


def test_simulate_pd_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    argv = [a for a in SMALL_GSP if a not in ("--workers", "2")]
    assert main(["simulate", *argv, "--pd", "1:2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["workers"] == 3 and doc["config"]["pd"] == "1:2"
    summary = doc["summary"]
    assert summary["n_rejected"] == 0 and summary["tpot_p99_s"] > 0
    assert summary["pd"]["splits"] + sum(summary["pd"]["alone"].values()) == summary["n_requests"]
    assert {r["worker"] for r in doc["requests"]} <= {"w1", "w2"}


def test_simulate_holder_prefill_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "hp.json"
    argv = ["simulate", *SMALL_GSP, "--pd", "holder_prefill", "--pd-holder-share", "0.25"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["workers"] == 2 and doc["config"]["pd"] == "holder_prefill"
    assert doc["config"]["pd_holder_share"] == 0.25
    summary = doc["summary"]
    assert summary["n_rejected"] == 0
    assert summary["pd"]["splits"] + sum(summary["pd"]["alone"].values()) == summary["n_requests"]


@pytest.mark.parametrize("spec", ["0:2", "2", "a:b"])
def test_a_bad_pd_split_is_refused(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL_GSP, "--pd", spec]) == 2
    assert "--pd" in capsys.readouterr().err


def test_a_holder_share_outside_0_1_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL_GSP, "--pd", "holder_prefill", "--pd-holder-share", "1"]) == 2
    assert "--pd-holder-share" in capsys.readouterr().err
