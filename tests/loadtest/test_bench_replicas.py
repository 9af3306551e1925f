"""`kvgate bench replicas`: one gateway process against K, end to end on real processes, and the
replay client spreading pinned connections over several URLs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path

import aiohttp
import pytest
import yaml

from loadtest import bench_replicas
from loadtest.bench_replicas import BASELINE, Rounds, Setup, paired_ratio
from loadtest.overhead_load import tree_cpu_by_process
from loadtest.peers.emulators import EmulatorPool, EmulatorSettings
from loadtest.report.sampler import scrape
from loadtest.traces.http_replay import ReplayConfig, replay
from loadtest.workloads.registry import make_workload

TINY = [
    "--workload",
    "gsp",
    "--workload-arg",
    "num_groups=3",
    "--workload-arg",
    "prompts_per_group=4",
    "--workload-arg",
    "system_prompt_len=256",
    "--workload-arg",
    "question_len=16",
    "--workload-arg",
    "output_len=4",
    "--workload-arg",
    "rate_per_s=40",
    "--max-requests",
    "12",
    "--workers",
    "2",
    "--gateways",
    "2",
    "--time-scale",
    "10",
    "--max-in-flight",
    "8",
]


def _descendants() -> set[int]:
    return set(tree_cpu_by_process(os.getpid())) - {os.getpid()}


@pytest.mark.e2e
def test_one_process_against_k_with_and_without_sync_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench_replicas.add_arguments(parser)
    out = tmp_path / "r.json"
    args = parser.parse_args([*TINY, "--repeats", "2", "--json", str(out), "--logs", str(tmp_path / "logs")])
    before = _descendants()
    assert bench_replicas.run(args) == 0
    assert _descendants() <= before  # workers, gateways and the broker all stopped
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "gateways" not in line]
    assert [r.split(" | ")[0] for r in rows] == [
        "| 1 process",
        "| 2 processes (round-robin connections), sync none",
        "| 2 processes (round-robin connections), sync broker",
    ]
    assert rows[0].count("1.000×") == 3  # the baseline against itself
    assert rows[0].endswith("| 0, 0 | 0, 0 |")  # one gateway has no peers to part from or wait for
    doc = json.loads(out.read_text())
    base, *others = doc["setups"]
    assert base["name"] == BASELINE and base["ratio_to_1"] == {m: 1.0 for m in bench_replicas.METRICS}
    for setup in others:
        assert len(setup["rounds"]) == 2 and not setup["failures"]
        assert all(isinstance(r[key], int) for r in setup["rounds"] for key in ("home_choices", "holds"))
        for metric in bench_replicas.METRICS:
            same_round = [
                mine[metric] / theirs[metric]
                for mine, theirs in zip(setup["rounds"], base["rounds"], strict=True)
            ]
            assert setup["ratio_to_1"][metric] == pytest.approx(statistics.median(same_round))
        assert all(r["n_errors"] == 0 and r["n_ok"] == 12 for r in setup["rounds"])


@pytest.mark.e2e
def test_every_gateway_logs_its_decisions_and_shares_calibration_when_asked(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_replicas.add_arguments(parser)
    logs = tmp_path / "logs"
    argv = [
        *TINY,
        "--repeats",
        "1",
        "--sync",
        "broker-shared-calibration",
        "--decision-log",
        "--logs",
        str(logs),
    ]
    assert bench_replicas.run(parser.parse_args(argv)) == 0
    ids = {r.request_id for r in make_workload("gsp", 0, TINY[3:14:2])}
    for setup, gateways in (("setup0", 1), ("setup1", 2)):
        seen: set[str] = set()
        for j in range(gateways):
            gateway = logs / "round1" / setup / f"gateway{j}"
            lines = (gateway / "decisions.jsonl").read_text().splitlines()
            seen |= {json.loads(line)["client_request_id"] for line in lines}
            config = yaml.safe_load((gateway / "gateway.yaml").read_text())
            assert config.get("sync", {}).get("share_calibration", False) is (setup == "setup1")
        assert ids <= seen  # every measured request, whichever gateway routed it


@pytest.mark.e2e
def test_processes_on_one_port_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate serve --processes 2` behind the same client; its children and nats-server stop too."""
    parser = argparse.ArgumentParser()
    bench_replicas.add_arguments(parser)
    out = tmp_path / "r.json"
    args = parser.parse_args(
        [*TINY, "--repeats", "1", "--front", "reuseport", "--sync", "broker", "--json", str(out)]
    )
    before = _descendants()
    assert bench_replicas.run(args) == 0
    assert _descendants() <= before
    assert "| 2 processes (one port, SO_REUSEPORT), sync broker |" in capsys.readouterr().out
    base, shared = json.loads(out.read_text())["setups"]
    assert shared["layout"] == "reuseport" and shared["rounds"][0]["n_ok"] == 12
    assert shared["ratio_to_1"]["hit_ratio"] == pytest.approx(
        shared["rounds"][0]["hit_ratio"] / base["rounds"][0]["hit_ratio"]
    )


def test_ratios_pair_each_round_with_its_own_baseline() -> None:
    base = Rounds(Setup(BASELINE, "single", 1, "none"), [{"hit_ratio": 0.5}, {"hit_ratio": 0.8}, None])
    mine = Rounds(Setup("k", "rr", 2, "broker"), [{"hit_ratio": 0.5}, {"hit_ratio": 0.4}, {"hit_ratio": 0.9}])
    # Rounds 1 and 2 pair (1.0 and 0.5); round 3 has no baseline. The ratio of medians would be 0.7/0.65.
    assert paired_ratio(mine, base, "hit_ratio") == pytest.approx(0.75)
    assert paired_ratio(mine, base, "ttft_p99_s") is None


def test_reuseport_is_refused_without_sharing(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_replicas.add_arguments(parser)
    assert bench_replicas.run(parser.parse_args([*TINY, "--front", "reuseport"])) == 2
    assert bench_replicas.run(parser.parse_args([*TINY, "--sync", "none,gossip"])) == 2
    assert "reuseport" in capsys.readouterr().err


@pytest.mark.e2e
def test_pinned_connections_spread_requests_over_every_url(tmp_path: Path) -> None:
    pool = EmulatorPool(2, EmulatorSettings(model="m", time_scale=10.0), tmp_path)
    reqs = make_workload(
        "gsp", 0, ["num_groups=2", "prompts_per_group=4", "system_prompt_len=64", "output_len=2"]
    )

    async def go() -> list[dict[str, float] | None]:
        cfg = ReplayConfig(pool.urls[0], "m", max_in_flight=4, spread_urls=tuple(pool.urls))
        results = await replay(reqs, cfg, lambda _req: {})
        assert [r.status for r in results] == [200] * len(reqs)
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(scrape(session, u) for u in pool.urls))

    try:
        metrics = asyncio.run(go())
    finally:
        pool.stop()
    queries = [m.get("vllm:prefix_cache_queries_total", 0.0) if m else 0.0 for m in metrics]
    assert all(q > 0 for q in queries), queries
