from __future__ import annotations

import argparse
import json

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
