"""`kvgate bench keys` runs and reports every figure (sizes small; timings are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_keys_reports() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "bench",
            "keys",
            "--tokens",
            "1024",
            "--repeats",
            "3",
            "--vocab-size",
            "300",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
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
