"""`kvgate bench overhead --processes 1,2`: each kvgate target once per process count."""

from __future__ import annotations

from loadtest.bench_overhead import build_targets


def test_kvgate_targets_run_once_per_process_count_against_one_process() -> None:
    targets = build_targets(["direct", "kvgate-cost"], False, (1, 2))
    assert [(t.name, t.baseline) for t in targets] == [
        ("direct", None),
        ("kvgate cost", "sglang-router cache_aware"),
        ("kvgate cost x2 processes", "kvgate cost"),
    ]
