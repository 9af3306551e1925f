"""`loadtest.bench_index_walk` runs a `cost` dispatch and completion per repeat."""

from __future__ import annotations

from loadtest.bench_index_walk import walk_ms


def test_each_repeat_times_one_dispatch_and_completion() -> None:
    times = walk_ms(64, 3)
    assert len(times) == 3 and all(t > 0 for t in times)
