from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import yaml

from gateway.cli import BENCHMARKS, main


def _tiny_trace(path: Path, n: int = 80) -> Path:
    """A Mooncake-format trace: 4 shared 2k-token prefixes, a private tail each, 4 requests/s."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        g = rng.randrange(4)
        ids = [g * 100 + k for k in range(4)] + [10_000 + i * 10 + k for k in range(rng.randrange(1, 3))]
        n_tokens = (len(ids) - 1) * 512 + rng.randrange(1, 512)
        out_tokens = rng.randrange(8, 32)
        row = {"timestamp": i * 250, "input_length": n_tokens, "output_length": out_tokens}
        rows.append({**row, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path) -> Path:
    trace = _tiny_trace(tmp_path / "tiny.jsonl")
    cfg = {
        "policies": ["round_robin", "cost"],
        "baselines": ["round_robin"],
        "workers": 2,
        "traces": {
            str(trace): {
                "ttft_slo_s": 0.3,
                "tpot_slo_s": 0.05,
                "reference_rate_scale": 1.0,
                "min_rate_scale": 0.25,
                "max_rate_scale": 64.0,
            }
        },
    }
    path = tmp_path / "goodput.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(tmp_path: Path, *extra: str) -> int:
    config = str(_config(tmp_path))
    return main(["bench", "goodput", "--config", config, "--out", str(tmp_path / "out"), *extra])


def test_goodput_is_a_bench_subcommand() -> None:
    assert BENCHMARKS["goodput"].module == "loadtest.goodput.cli"


def test_a_run_prints_a_table_and_writes_report_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, "--quiet") == 0
    out = capsys.readouterr().out
    assert "| policy | goodput capacity (rate scale) | vs round_robin |" in out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert {"round_robin", "cost"} <= set(rows)
    doc = json.loads((tmp_path / "out" / "goodput.json").read_text())
    assert doc["config"]["git_sha"] and doc["config"]["goodput"]["attainment_share"] == 0.9
    (trace,) = doc["traces"].values()
    for policy in ("round_robin", "cost"):
        cap = trace["capacities"][policy]
        assert cap["load"] is not None and cap["failing_load"] is not None
        assert cap["failing_load"] / cap["load"] <= 1.05
        points = {p["rate_scale"]: p for p in trace["points"][policy]}
        assert points[cap["load"]]["attainment"] >= 0.9 and points[cap["load"]]["complete"]
        assert points[cap["failing_load"]]["attainment"] < 0.9
        assert points[1.0]["complete"], "the reference rate is always replayed in full"
    assert (tmp_path / "out" / "report.md").read_text().count("| round_robin |") == 1
    assert (tmp_path / "out" / "goodput-tiny.jsonl.png").stat().st_size > 0


def test_resume_reuses_every_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(tmp_path, "--quiet") == 0
    first = capsys.readouterr().out
    points = (tmp_path / "out" / "points.jsonl").read_text()
    assert _run(tmp_path, "--resume") == 0
    second = capsys.readouterr()
    assert (tmp_path / "out" / "points.jsonl").read_text() == points, "a resumed run simulated again"
    assert "rate " not in second.err, "no point was simulated"
    assert first.split("wrote")[0] == second.out.split("wrote")[0]


def test_without_matplotlib_the_table_still_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert _run(tmp_path, "--quiet", "--max-requests", "30") == 0
    captured = capsys.readouterr()
    assert "matplotlib is not installed" in captured.err and "kvgate[bench]" in captured.err
    assert "| cost |" in captured.out
    assert not list((tmp_path / "out").glob("*.png"))


def test_bad_names_fail_with_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(tmp_path, "--policies", "cost,nope") == 2
    assert "nope" in capsys.readouterr().err
    assert main(["bench", "goodput", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_suggest_slos_prints_the_derivation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(tmp_path, "--suggest-slos") == 0
    out = capsys.readouterr().out
    assert "own prefill p90" in out and "ttft_slo_s" in out and "tpot_slo_s 0.1" in out


def test_a_pd_row_gets_its_own_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["policies"] = ["cost", {"policy": "cost", "pd": "1:1"}]
    doc["baselines"] = ["cost"]
    doc["subject"] = "cost 1:1"
    path.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    args = ["bench", "goodput", "--config", str(path), "--out", str(out), "--quiet", "--max-requests", "30"]
    assert main([*args, "--policies", "cost 1:1"]) == 0
    assert "| cost 1:1 |" in capsys.readouterr().out
    assert main([*args, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "| cost |" in printed and "| cost 1:1 |" in printed and "vs cost" in printed
    (trace,) = json.loads((out / "goodput.json").read_text())["traces"].values()
    assert set(trace["capacities"]) == {"cost", "cost 1:1"}
    rows = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert {json.loads(r["policy"])["pd"] for r in rows if r["policy"] != "cost"} == {"1:1"}
