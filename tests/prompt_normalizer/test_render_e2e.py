"""Render mode end to end: `kvgate normalize --render-url` against a real emulated vLLM worker
process on 127.0.0.1 (one token per UTF-8 byte of its rendered prompt, so spans are checkable)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.support.processes import running_emulator

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. Current time: 12:30:00."
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture
def emulator() -> Iterator[str]:
    with running_emulator("--model", "m", "--log-level", "warning") as url:
        yield url


def test_render_mode_spans_and_volatile_tail(emulator: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "normalizer:\n  mode: render\n  volatile_rules:\n"
        "    - {name: clock, pattern: ' Current time: [0-9:]+\\.', roles: [system], action: move_to_end}\n"
    )
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}],
        "tools": TOOLS,
    }
    proc = _normalize(policy, emulator, 8, json.dumps(body))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # The emulator renders "<|system|>\n...<|end|>\n<|tools|>\n...<|end|>\n" first; one token per byte.
    tools_json = orjson.dumps(TOOLS, option=orjson.OPT_SORT_KEYS).decode()
    immutable = f"<|system|>\nYou are a careful assistant.<|end|>\n<|tools|>\n{tools_json}<|end|>\n"
    conversation = "<|user|>\nhello there<|end|>\n"
    volatile = "<|system|>\n Current time: 12:30:00.<|end|>\n<|assistant|>\n"
    total = len((immutable + conversation + volatile).encode())
    assert out["n_tokens"] == total
    assert [(z["zone"], z["start_token"], z["end_token"]) for z in out["zones"]] == [
        ("immutable", 0, len(immutable)),
        ("append_only", len(immutable), len(immutable + conversation)),
        ("volatile", len(immutable + conversation), total),
    ]
    assert len(out["block_keys"]) == total // 8
    assert "careful" not in proc.stdout and "hello" not in proc.stdout


def test_render_mode_completions_text(emulator: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("normalizer:\n  mode: render\n")
    prompt = "The quick brown fox jumps over the lazy dog"
    proc = _normalize(policy, emulator, 4, json.dumps({"model": "m", "prompt": prompt}))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["endpoint"] == "completions" and out["n_tokens"] == len(prompt.encode())
    assert [z["zone"] for z in out["zones"]] == ["append_only"] and len(out["block_keys"]) == len(prompt) // 4


def _normalize(policy: Path, emulator: str, block_size: int, body: str) -> subprocess.CompletedProcess[str]:
    """`kvgate normalize` in render mode against the emulator, the request body on stdin."""
    argv = [sys.executable, "-m", "gateway.cli", "normalize", "--policy", str(policy)]
    argv += ["--render-url", emulator, "--block-size", str(block_size)]
    return subprocess.run(argv, input=body, capture_output=True, text=True, timeout=60)
