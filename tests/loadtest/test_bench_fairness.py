"""The fairness benchmark's parts, and one tiny run on real processes (no figure is asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest import bench_fairness
from loadtest.fairness_load import percentile, queue_waits_ms


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 99) == 3.0 and math.isnan(percentile([], 50))


def test_queue_waits_come_from_the_access_lines(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    lines = [
        '{"event": "started"}',
        json.dumps({"client_request_id": "a", "queue_ms": 12.5, "status": 200}),
        json.dumps({"client_request_id": "b", "queue_ms": None, "status": 200}),
        "INFO something else",
        '{"client_request_id": "c", "queue_ms": 1',  # a line cut short
    ]
    log.write_text("\n".join(lines))
    assert queue_waits_ms(log) == {"a": 12.5, "b": 0.0}


def test_a_tiny_run_measures_every_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fairness.json"
    argv = ["--workers", "1", "--ratio", "2", "--light-clients", "1", "--max-tokens", "8"]
    argv += ["--duration-s", "1.5", "--warmup-s", "0", "--time-scale", "4", "--json", str(out)]
    assert bench_fairness.main(argv) == 0
    report = json.loads(out.read_text())
    phases = [(row["phase"], row["tenant"]) for row in report["rows"]]
    assert phases == [
        ("alone", "light"),
        ("flood 2:1 (fair)", "light"),
        ("flood 2:1 (fair)", "heavy"),
        ("flood 2:1 (fifo)", "light"),
        ("flood 2:1 (fifo)", "heavy"),
    ]
    assert all(row["requests"] > 0 and row["non_200"] == {} for row in report["rows"])
    assert report["meta"]["git_sha"] and set(report["ratios"]) == {"flood 2:1 (fair)", "flood 2:1 (fifo)"}
    assert "light p99 latency, flood 2:1 (fair) / alone" in capsys.readouterr().out
