from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main

REQUIRED_SUMMARY = (
    "n_requests", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s", "tpot_mean_s", "e2e_p99_s",
    "throughput_tok_s", "hit_ratio", "ceiling_infinite", "ceiling_pooled_lru", "imbalance", "utilization",
    "request_hit_ratio", "hit_length_histogram", "cold_start", "steady_state",
)  # fmt: skip

SMALL_GSP = [
    "--workload", "gsp", "--workload-arg", "num_groups=4", "--workload-arg", "prompts_per_group=6",
    "--workload-arg", "system_prompt_len=1024", "--workload-arg", "output_len=16",
    "--workers", "2", "--quiet",
]  # fmt: skip


def _simulate(tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / "sim.json"
    assert main(["simulate", *SMALL_GSP, "--json", str(out), *extra]) == 0
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


def test_json_has_every_summary_field_and_one_record_per_request(tmp_path: Path) -> None:
    doc = _simulate(tmp_path, "--policy", "least_load")
    summary = doc["summary"]
    assert isinstance(summary, dict)
    for key in REQUIRED_SUMMARY:
        assert key in summary, key
    assert summary["n_requests"] == 24 and summary["n_rejected"] == 0
    for part in ("cold_start", "steady_state"):
        assert {"hit_ratio", "ttft_p50_s", "ttft_p99_s", "n_requests"} <= set(summary[part])
    assert summary["cold_start"]["n_requests"] + summary["steady_state"]["n_requests"] == 24
    records = doc["requests"]
    assert isinstance(records, list) and len(records) == 24
    r = records[0]
    assert r["prompt_tokens"] == 1024 + 128 and r["output_tokens"] == 16 and r["ttft_s"] > 0
    # 4 groups x 6 prompts: at best 5 of 6 prompts per group hit the 1024-token system prompt.
    assert summary["ceiling_infinite"] == pytest.approx((5 / 6) * 1024 / 1152, abs=0.01)
    assert 0 < summary["hit_ratio"] <= summary["ceiling_infinite"] + 1e-9
    config = doc["config"]
    assert isinstance(config, dict) and config["policy"] == "least_load" and config["git_sha"]


def test_same_seed_same_result(tmp_path: Path) -> None:
    a = _simulate(tmp_path, "--seed", "5")["summary"]
    b = _simulate(tmp_path, "--seed", "5")["summary"]
    assert isinstance(a, dict) and isinstance(b, dict)
    a.pop("wall_time_s")
    b.pop("wall_time_s")
    assert a == b


def test_policy_config_file_is_used(tmp_path: Path) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text("policy: least_load\nseed: 1\n")
    doc = _simulate(tmp_path, "--policy-config", str(cfg))
    assert doc["config"]["policy"] == "least_load"  # type: ignore[index]


def test_bad_input_fails_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL_GSP, "--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'nope'" in err and "round_robin" in err
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl"), "--quiet"]) == 2
    assert "no such trace file" in capsys.readouterr().err
    bad = tmp_path / "p.yaml"
    bad.write_text("policy: least_load\nbogus: 1\n")
    assert main(["simulate", *SMALL_GSP, "--policy-config", str(bad)]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["simulate", *SMALL_GSP, "--profile", "no-such-gpu"]) == 2
    assert main(["simulate", *SMALL_GSP, "--rate-scale", "0"]) == 2
    assert main(["simulate", "--workload", "nope", "--quiet"]) == 2
    assert main(["simulate", *SMALL_GSP, "--tenant-isolation", "gsp=open"]) == 2
    assert "known: agent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", *SMALL_GSP, "--kv-blocks-per-worker", "0"])
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", "x", "--workload", "gsp"])


def test_a_trace_runs_end_to_end(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 100 + i]}
        for i in range(12)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "t.json"
    assert main(["simulate", "--trace", str(trace), "--workers", "2", "--quiet", "--json", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    # 11 of 12 requests could reuse the two shared blocks (1024 of 1500 tokens).
    assert s["ceiling_infinite"] == pytest.approx(11 * 1024 / (12 * 1500))
    # Round robin over 2 workers: each worker's first request is cold, the rest hit 1024 tokens.
    assert s["cached_tokens"] == 10 * 1024


def test_chat_prompts_count_the_emulator_template_tokens(tmp_path: Path) -> None:
    from loadtest.emulator.chat_template import render_chat
    from loadtest.workloads.openai_body import chat_messages, chat_tools
    from loadtest.workloads.records import ChatPrompt
    from loadtest.workloads.registry import make_workload

    out = tmp_path / "a.json"
    args = ["--workload", "agent", "--workload-arg", "n_sessions=3", "--workload-arg", "turns_per_session=2"]
    assert main(["simulate", *args, "--workers", "2", "--quiet", "--json", str(out)]) == 0
    records = {r["request_id"]: r for r in json.loads(out.read_text())["requests"]}
    for req in make_workload("agent", 0, ["n_sessions=3", "turns_per_session=2"]):
        assert isinstance(req.prompt, ChatPrompt)
        rendered = render_chat(chat_messages(req.prompt), chat_tools(req.prompt) or None)
        assert records[req.request_id]["prompt_tokens"] == len(rendered.encode())
