"""`kvgate bench abuse`: a few cheap probes against a real stack, run as a user runs the command,
and the verdict machinery on its own (a failing or overrunning probe fails the run)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtest.abuse.probe import Observation, Probe, run_probe
from loadtest.abuse.report import Verdict, table
from loadtest.abuse.settings import QUICK

REPO = Path(__file__).resolve().parents[2]
CHEAP = ("deep_json", "tiny_prompt", "trailing_slash", "metrics_port", "garbage_worker")


def _bench(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gateway.cli", "bench", "abuse", *args]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the bench stops its gateway and workers on SIGTERM
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"bench abuse overran {timeout_s} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_cheap_probes_pass_against_a_real_stack_and_print_the_table() -> None:
    done = _bench("--quick", "--only", ",".join(CHEAP))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| probe | expected | observed | ok |"
    by_probe = {row.split(" | ")[0].removeprefix("| "): row for row in rows[1:]}
    assert sorted(by_probe) == sorted(CHEAP)
    assert all(row.endswith("| yes |") for row in by_probe.values())
    assert "| 400 invalid_request |" in by_probe["deep_json"]
    assert "| 404, no Location |" in by_probe["trailing_slash"]
    assert "502 bad_gateway, 502 bad_gateway" in by_probe["garbage_worker"]


def test_an_unknown_probe_is_refused_before_anything_starts() -> None:
    done = _bench("--only", "deep_json,nosuch", timeout_s=30)
    assert done.returncode == 2
    assert "unknown probe nosuch" in done.stderr and "trailing_slash" in done.stderr


def _probe(run: Observation | Exception | None) -> Probe:
    async def body(ctx: object) -> Observation:
        if isinstance(run, Exception):
            raise run
        if run is None:
            await asyncio.sleep(10)  # overruns its limit
        assert isinstance(run, Observation)
        return run

    return Probe("p", lambda s: "expected", body, lambda s: 0.05)


@pytest.mark.parametrize(
    ("outcome", "observed", "ok"),
    [
        (Observation("fine", True), "fine", True),
        (Observation("off", False), "off", False),
        (RuntimeError("boom"), "probe error: RuntimeError: boom", False),
        (None, "did not finish within its limit of 0 s", False),
    ],
)
def test_a_probe_that_fails_raises_or_overruns_is_a_failed_verdict(
    outcome: Observation | Exception | None, observed: str, ok: bool
) -> None:
    ctx = SimpleNamespace(sizes=QUICK)  # all a probe runner reads of its context
    verdict = asyncio.run(run_probe(_probe(outcome), ctx))  # type: ignore[arg-type]
    assert (verdict.probe, verdict.expected, verdict.observed, verdict.ok) == ("p", "expected", observed, ok)


def test_the_table_marks_failures_and_keeps_cells_apart() -> None:
    text = table([Verdict("a", "x | y", "seen", True), Verdict("b", "x", "not seen", False)])
    assert text.splitlines() == [
        "| probe | expected | observed | ok |",
        "|---|---|---|---|",
        "| a | x / y | seen | yes |",
        "| b | x | not seen | **NO** |",
    ]
