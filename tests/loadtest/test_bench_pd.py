"""`kvgate bench pd`: kvgate's side on real P/D emulated workers, tiny sizes (smg is not needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import BENCHMARKS, main
from loadtest.bench_pd import parse_routers
from loadtest.cli_args import UsageError, worker_split
from loadtest.report.pd import aggregate


def test_pd_is_a_bench_subcommand() -> None:
    assert BENCHMARKS["pd"].module == "loadtest.bench_pd"


def test_splits_and_router_names_are_checked() -> None:
    assert worker_split("2:3") == (2, 3)
    for bad in ("4", "0:2", "a:b"):
        with pytest.raises(UsageError):
            worker_split(bad)
    assert parse_routers("kvgate:cost, smg:cache_aware") == ["kvgate:cost", "smg:cache_aware"]
    for bad in ("sglang-router:cache_aware", "kvgate", ""):
        with pytest.raises(UsageError):
            parse_routers(bad)


def _row(router: str, repeat: int, ttft: float) -> dict[str, object]:
    return {
        "router": router, "repeat": repeat, "status": "ok", "n_sent": 10, "n_errors": 0,
        "ttft_p50_s": ttft, "ttft_p99_s": ttft * 2, "tpot_p99_s": 0.01, "prefill_hit_ratio": 0.5,
        "reported_hit_ratio": 0.5, "failed_transfers": 0.0, "split_share": 1.0,
    }  # fmt: skip


def test_ratios_are_taken_within_a_repeat_then_their_median() -> None:
    rows = [
        _row("kvgate:cost", 1, 1.0), _row("smg:cache_aware", 1, 2.0),
        _row("kvgate:cost", 2, 3.0), _row("smg:cache_aware", 2, 3.0),
        _row("kvgate:cost", 3, 4.0), _row("smg:cache_aware", 3, 2.0),
    ]  # fmt: skip
    table, ref = aggregate(rows, ["kvgate:cost", "smg:cache_aware"])
    assert ref == "smg:cache_aware"
    kv = table["kvgate:cost"]
    assert kv["ttft_p50_s"] == 3.0 and kv["repeats"] == 3
    assert kv["ttft_p50_s_vs_ref"] == 1.0  # median of 0.5, 1.0, 2.0 (not 3.0 / 2.0)
    assert table["smg:cache_aware"]["ttft_p50_s_vs_ref"] == 1.0


@pytest.mark.e2e
def test_kvgate_side_runs_on_prefill_and_decode_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["bench", "pd", "--pd", "1:1", "--workload", "gsp", "--max-requests", "6", "--repeats", "1"]
    args += ["--workload-arg", "num_groups=2", "--workload-arg", "prompts_per_group=3"]
    args += ["--workload-arg", "output_len=4", "--workload-arg", "rate_per_s=20"]
    args += ["--routers", "kvgate:cost", "--time-limit-s", "30", "--out", str(out), "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| kvgate:cost |" in printed and "SGLang bootstrap" in printed
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    assert run["status"] == "ok" and run["n_sent"] == 6 and run["n_errors"] == 0
    assert run["failed_transfers"] == 0
    assert run["split_share"] == 1.0  # every request's decode worker received the KV
    # Requests of a group after its first hit the system prompt on the prefill worker, and kvgate
    # reports the prefill worker's cached tokens to the client.
    assert 0 < run["prefill_hit_ratio"] < 1
    assert run["reported_hit_ratio"] == pytest.approx(run["prefill_hit_ratio"], abs=0.05)
    assert run["tpot_p99_s"] is not None and run["ttft_p50_s"] is not None
    assert doc["config"]["load_average"] and doc["config"]["pd"] == "1:1"


def test_counters_are_summed_over_labels() -> None:
    from loadtest.bench_pd import parse_counters

    text = (
        "# HELP vllm:nixl_num_failed_transfers x\n"
        'vllm:nixl_num_failed_transfers{engine="0",model_name="m"} 2.0\n'
        'vllm:nixl_num_failed_transfers{engine="1",model_name="m"} 1.0\n'
        'vllm:nixl_xfer_time_seconds_count{engine="0"} 7\n'
        'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1"} 3\n'
        "vllm:prefix_cache_hits_total 5\n"
    )
    assert parse_counters(text) == {
        "vllm:nixl_num_failed_transfers": 3.0,
        "vllm:nixl_xfer_time_seconds_count": 7.0,
        "vllm:prefix_cache_hits_total": 5.0,
    }
