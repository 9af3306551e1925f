from __future__ import annotations

import argparse
import dataclasses
import json
import random

import pytest

from policies import bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
def test_bench_decision_prints_every_policy_against_round_robin(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(
        "--workers", "8", "--repeats", "5", "--background-prompts", "10", "--prompt-tokens", "64", "--json"
    )
    assert bench.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["workers"] == 8 and "git_sha" in doc["config"]
    names = [r["policy"] for r in doc["results"]]
    assert names == [
        "round_robin",
        "cost",
        "sglang_cache_aware",
        "preble_e2",
        "consistent_hash",
        "least_load",
    ]
    assert all(r["x_round_robin"] is not None and r["median_us"] > 0 for r in doc["results"])


def test_bench_decision_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--prompt-tokens", "4")) == 2
    assert "at least one block" in capsys.readouterr().err


def test_bench_decision_hands_over_changed_views(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(
        "--workers", "8", "--repeats", "5", "--background-prompts", "10", "--prompt-tokens", "64",
        "--policies", "round_robin", "cost", "--changed-views", "3", "--json",
    )  # fmt: skip
    assert bench.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["changed_views"] == 3
    assert [r["policy"] for r in doc["results"]] == ["round_robin", "cost"]
    assert bench.run(_args("--changed-views", "-1")) == 2


def test_bench_decision_times_cost_with_prefill_progress(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(
        "--workers", "8", "--repeats", "5", "--background-prompts", "10", "--prompt-tokens", "64",
        "--policies", "round_robin", "cost", "--prefill-progress", "1", "--json",
    )  # fmt: skip
    assert bench.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["prefill_progress"] == 1.0
    assert [r["policy"] for r in doc["results"]] == ["round_robin", "cost"]
    assert bench.run(_args("--prefill-progress", "1.5")) == 2


def test_bench_decision_times_cost_through_the_holder_prefill_chooser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _args(
        "--workers", "8", "--repeats", "5", "--background-prompts", "10", "--prompt-tokens", "64",
        "--policies", "round_robin", "cost", "--pd-holder", "--json",
    )  # fmt: skip
    assert bench.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["pd_holder"] is True
    assert [r["policy"] for r in doc["results"]] == ["round_robin", "cost", "cost+holder_prefill"]
    assert all(r["median_us"] > 0 for r in doc["results"])


def test_bench_views_carry_backlog_starts_before_the_timed_decisions() -> None:
    views = bench._views(random.Random(0), 64)
    started = bench._started(0, views)
    busy = [w for w in started if w.in_flight_prefill_tokens > 0]
    assert busy and all(w.prefill_started_s is not None and w.prefill_started_s < 1.0 for w in busy)
    assert [dataclasses.replace(w, prefill_started_s=None) for w in started] == views
