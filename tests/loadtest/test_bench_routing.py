"""The HTTP side of the routing benchmark on real emulated workers (CI has no peers installed)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from loadtest.peers.emulators import EmulatorPool, EmulatorSettings
from loadtest.report.sampler import parse_vllm_metrics
from loadtest.traces.http_replay import ReplayConfig, replay
from loadtest.workloads.records import BlockPrompt, ChatMessage, ChatPrompt, TextPrompt, WorkloadRequest


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorPool]:
    p = EmulatorPool(1, EmulatorSettings(model="emu", time_scale=1.0), tmp_path_factory.mktemp("emu"))
    try:
        yield p
    finally:
        p.stop()
    assert all(proc.proc.poll() is not None for proc in p.procs)


@pytest.mark.e2e
def test_replay_measures_ttft_and_cached_tokens_over_http(pool: EmulatorPool) -> None:
    # 4000 tokens: a's prefill is ~100 ms modelled, b's (all but its last block cached) one short
    # step, so b answers first by far more than this machine's scheduling delays.
    block = BlockPrompt((7, 8), 2048, 4000, salt="test")
    reqs = [
        WorkloadRequest("a", 0.0, "t", "s", block, 4),
        WorkloadRequest("b", 0.3, "t", "s", block, 4),
        WorkloadRequest("c", 0.3, "t", "s", TextPrompt("hello " * 20), 3),
        WorkloadRequest(
            "d", 0.35, "t", "s", ChatPrompt((ChatMessage("system", "be brief"), ChatMessage("user", "hi"))), 5
        ),
    ]
    cfg = ReplayConfig(base_url=pool.urls[0], model="emu", time_limit_s=10, grace_s=20)
    results = {r.request_id: r for r in asyncio.run(replay(reqs, cfg, lambda r: {}))}
    assert all(r.error is None and r.status == 200 for r in results.values()), results
    a, b = results["a"], results["b"]
    assert a.prompt_tokens == 4000 and a.completion_tokens == 4
    assert a.cached_tokens == 0 and b.cached_tokens == 3984  # the full 16-token blocks before the last token
    assert a.ttft_s is not None and b.ttft_s is not None and b.ttft_s < a.ttft_s
    assert b.sent_s == pytest.approx(0.3, abs=0.15)  # sent at its arrival time
    assert results["c"].prompt_tokens == 120 and results["d"].completion_tokens == 5


@pytest.mark.e2e
def test_replay_stops_at_the_time_limit(pool: EmulatorPool) -> None:
    reqs = [WorkloadRequest(f"r{i}", float(i), "t", "s", TextPrompt("x" * 50), 2) for i in range(5)]
    cfg = ReplayConfig(base_url=pool.urls[0], model="emu", time_limit_s=1.5, grace_s=5)
    results = asyncio.run(replay(reqs, cfg, lambda r: {}))
    assert sorted(r.request_id for r in results) == ["r0", "r1"]


@pytest.mark.e2e
def test_replay_records_http_errors(pool: EmulatorPool) -> None:
    reqs = [WorkloadRequest("r", 0.0, "t", "s", TextPrompt("x" * 50), 2)]
    cfg = ReplayConfig(base_url=pool.urls[0], model="no-such-model", time_limit_s=5)
    (res,) = asyncio.run(replay(reqs, cfg, lambda r: {}))
    assert res.status in (400, 404) and res.error and res.ttft_s is None


def test_metrics_parser_reads_vllm_names() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 1.5e3\n'
        "vllm:other 9\n"
    )
    assert parse_vllm_metrics(text) == {
        "vllm:num_requests_running": 3.0,
        "vllm:prefix_cache_hits_total": 1500.0,
    }


@pytest.mark.slow
def test_bench_reports_missing_peers_and_writes_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_PEERS_DIR", str(tmp_path / "no-peers"))
    out = tmp_path / "out"
    args = ["bench", "routing", "--workload", "gsp", "--workload-arg", "num_groups=2", "--workers", "1"]
    args += ["--max-requests", "4", "--routers", "sglang-router,litellm", "--out", str(out), "--quiet"]
    assert main(args) == 1  # nothing could run
    doc = json.loads((out / "results.json").read_text())
    assert doc["routers"]["sglang-router"]["status"] == "missing"
    assert "install.sh sglang-router" in doc["routers"]["sglang-router"]["detail"]
    assert doc["routers"]["litellm"]["status"] == "missing"
    assert doc["config"]["n_requests"] == 4 and 0 < doc["ceilings"]["infinite"] < 1
    report = (out / "report.md").read_text()
    assert "| sglang-router | missing" in report
    assert (out / "ttft_cdf.png").stat().st_size > 0


def test_bench_rejects_unknown_routers(tmp_path: Path) -> None:
    assert main(["bench", "routing", "--routers", "nginx", "--out", str(tmp_path), "--quiet"]) == 2


@pytest.mark.e2e
def test_waiting_for_a_client_slot_counts_in_ttft(pool: EmulatorPool) -> None:
    reqs = [WorkloadRequest(f"q{i}", 0.0, "t", "s", TextPrompt(f"{i}" * 300), 20) for i in range(2)]
    cfg = ReplayConfig(base_url=pool.urls[0], model="emu", max_in_flight=1, time_limit_s=5, grace_s=20)
    first, second = sorted(asyncio.run(replay(reqs, cfg, lambda r: {})), key=lambda r: r.queued_s)
    assert first.sent_s == second.sent_s == 0.0
    assert first.e2e_s is not None and second.ttft_s is not None
    assert second.queued_s >= first.e2e_s * 0.9 and second.ttft_s > second.queued_s


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_runs_kvgate_in_front_of_emulated_workers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["bench", "routing", "--workload", "gsp", "--workload-arg", "num_groups=2", "--workers", "2"]
    args += ["--workload-arg", "prompts_per_group=3", "--workload-arg", "output_len=4"]
    args += ["--max-requests", "6", "--out", str(out), "--quiet"]
    rc = main([*args, "--routers", "kvgate:round_robin,kvgate:cost+holder_prefill"])
    routers = json.loads((out / "results.json").read_text())["routers"]
    assert rc == 0
    for name in ("kvgate:round_robin", "kvgate:cost+holder_prefill"):
        summary = routers[name]
        assert summary["status"] == "ok", summary
        assert summary["n_ok"] == 6 and summary["hit_ratio"] is not None and summary["hit_ratio"] > 0
    # `+holder_prefill` gives the pool a vLLM pd section in that mode; the plain router none.
    pool = yaml.safe_load((out / "logs" / "kvgate_cost+holder_prefill" / "gateway.yaml").read_text())[
        "pools"
    ][0]
    assert pool["pd"] == {"protocol": "vllm", "mode": "holder_prefill"}
    plain = yaml.safe_load((out / "logs" / "kvgate_round_robin" / "gateway.yaml").read_text())["pools"][0]
    assert "pd" not in plain


def test_kvgate_rows_take_a_holder_share_and_policy_options(tmp_path: Path) -> None:
    from loadtest.bench_routing import _router_command

    options = tmp_path / "opts.yaml"
    options.write_text("policy: round_robin\ncost:\n  branch_load_weight: 0.5\n")
    args = argparse.Namespace(model="emu", seed=3, decision_log=False, kvgate_policy_config=str(options))
    urls = ["http://127.0.0.1:1"]
    cmd = _router_command("kvgate:cost+holder_prefill@0.25", args, urls, ["t"], tmp_path)
    assert cmd.name == "kvgate:cost+holder_prefill@0.25"
    assert cmd.config_text is not None
    pool = yaml.safe_load(cmd.config_text)["pools"][0]
    assert pool["pd"] == {"protocol": "vllm", "mode": "holder_prefill", "holder_share": 0.25}
    # The row's policy wins over the file's; the file's options come along.
    policy = yaml.safe_load((tmp_path / "policy.yaml").read_text())
    assert policy == {"policy": "cost", "seed": 3, "cost": {"branch_load_weight": 0.5}}
