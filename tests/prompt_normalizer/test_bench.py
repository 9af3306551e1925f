"""`kvgate bench keys` runs and reports every figure (sizes small; timings are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def _bench_keys(*args: str) -> dict[str, Any]:
    """`kvgate bench keys ... --json`, run as a command; its report."""
    command = [sys.executable, "-m", "gateway.cli", "bench", "keys", *args, "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def test_bench_keys_reports() -> None:
    report = _bench_keys(
        "--tokens", "1024", "--repeats", "3", "--vocab-size", "300", "--chat-requests", "200"
    )
    for name in (
        "key_ms",
        "baseline_per_token_packing_ms",
        "floor_one_xxh3_ms",
        "tokenize_ms_per_1k_tokens",
        "template_render_ms_per_1k_tokens",
        "chat_canonicalize_total_ms",
        "git_sha",
    ):
        assert name in report
    assert report["config"]["tokens"] == 1024 and report["chat_tokens"] >= 1024
    chat = report["chat_request"]
    for name in ("floor_dumps_xxh3_us", "approximate_us", "approximate_public_keys_us", "tokenizer_us"):
        assert chat[name] > 0


def test_bench_keys_chat_only_reports_per_request_time_and_floor() -> None:
    report = _bench_keys("--chat-only", "--vocab-size", "300", "--chat-requests", "100")
    chat = report["chat_request"]
    assert report["git_sha"] and report["config"]["seed"] == 0
    assert 1000 < chat["chat_body_bytes"] < 2000
    ratio = chat["approximate_us"] / chat["floor_dumps_xxh3_us"]
    assert chat["approximate_ratio_vs_floor"] == pytest.approx(ratio)
    assert chat["tokenizer_tokens"] > 0 and chat["tokenizer_us"] > 0 and chat["tokenizer_bpe_encode_us"] > 0
