"""`kvgate bench overhead --processes 1,2`: each kvgate target once per process count, run as
`kvgate serve --processes N`; and where the cores went during a run."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench_overhead import build_targets
from loadtest.overhead_load import LoadResult, builtin_load, chat_bodies, spawn, stop, wait_ready
from loadtest.overhead_report import cpu_report
from loadtest.overhead_runner import BenchConfig, CpuShare, TargetResult, measure
from loadtest.overhead_targets import Target, kvgate_argv, start_backend
from loadtest.ports import free_port


def test_kvgate_targets_run_once_per_process_count_against_one_process() -> None:
    targets = build_targets(["direct", "kvgate-cost"], False, (1, 2))
    assert [(t.name, t.baseline) for t in targets] == [
        ("direct", None),
        ("kvgate cost", "sglang-router cache_aware"),
        ("kvgate cost x2 processes", "kvgate cost"),
    ]


def test_more_than_one_process_runs_kvgate_serve_with_processes(tmp_path: Path) -> None:
    one, two = kvgate_argv(tmp_path / "c.yaml"), kvgate_argv(tmp_path / "c.yaml", 2)
    assert one[-3:] == ["serve", "--config", str(tmp_path / "c.yaml")] and "--processes" not in one
    assert two == [*one, "--processes", "2"]


def test_cpu_shares_name_the_router_processes_and_what_else_ran(tmp_path: Path) -> None:
    """A real run: a static backend stands in for the router, in front of another one."""
    backend, backend_url, _ = start_backend("builtin", tmp_path)

    def start(upstream: str, workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
        port = free_port()
        proc = spawn(
            [sys.executable, "-m", "loadtest.static_backend", "--port", str(port)], workdir / "r.log"
        )
        wait_ready(f"http://127.0.0.1:{port}/health", proc, workdir / "r.log")
        return proc, f"http://127.0.0.1:{port}"

    cfg = BenchConfig(1, 0, (4,), 0, "builtin", "builtin", False, ())
    result = TargetResult("stand-in", None)
    bodies = chat_bodies(0)
    try:
        measure(
            Target("stand-in", None, start),
            (backend_url, backend.pid),
            cfg,
            tmp_path,
            lambda url, c, dur: asyncio.run(builtin_load(url, bodies, c, dur)),
            result,
        )
    finally:
        stop(backend)
    assert result.missing is None and len(result.cpu) == len(result.runs) == 1
    share = result.shares(4)[0]
    assert share.router > share.backend  # the stand-in answers without the backend
    assert share.load_generator > 0 and share.machine >= share.router
    assert [name[:6] for name, _ in share.router_processes] == ["python"]  # one process
    run = result.runs[0]
    assert run.cpu_us_per_request is not None
    assert run.cpu_us_per_request == pytest.approx(share.router * share.wall_s * 1e6 / run.requests)
    table = "\n".join(cpu_report([result], 4))
    assert "| stand-in |" in table and "req/s per router core" in table


def test_the_cpu_table_leaves_out_targets_without_a_router_process() -> None:
    direct = TargetResult("direct", None, [LoadResult(4, 10, 0, 1.0, 10.0, 1.0, 2.0)])
    share = CpuShare(0.0, (), 0.5, 0.5, 1.2, 1.0)
    direct.cpu.append(share)
    assert cpu_report([direct], 4) == []
    assert share.others == pytest.approx(0.2)


def test_processes_scale_against_one_process_round_by_round() -> None:
    def target(name: str, baseline: str | None, *rounds: tuple[float, float]) -> TargetResult:
        t = TargetResult(name, baseline)
        for rps, cores in rounds:
            t.runs.append(LoadResult(64, 100, 0, 1.0, rps, 1.0, 2.0, 100.0))
            t.cpu.append(CpuShare(cores, (("python", cores),), 0.1, 0.1, 2.0, 1.0))
        return t

    one = target("kvgate cost", "sglang-router cache_aware", (1000, 0.9), (500, 0.5), (800, 0.8))
    two = target("kvgate cost x2 processes", "kvgate cost", (1500, 1.3), (1000, 1.0), (1200, 1.2))
    rows = {line.split(" | ")[0]: line for line in cpu_report([one, two], 64)}
    # Same-round req/s ratios 1.5, 2.0, 1.5 and core ratios 1.44, 2.0, 1.5: medians 1.5 and 1.5.
    assert rows["| kvgate cost x2 processes"].endswith("| 1.50x, 1.50x |")
    assert rows["| kvgate cost"].endswith("| - |")  # its baseline is not a kvgate target
