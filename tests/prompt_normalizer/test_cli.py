"""`kvgate normalize` as a user runs it: a subprocess reading one request on stdin."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.template import ChatTemplateTokenizer
from tests.support.processes import free_port

SECRET_WORDS = ("Zanzibar", "Quokka", "Paris")
BODY = {
    "model": "tiny",
    "user": "session-1",
    "messages": [
        {"role": "system", "content": "You are a careful assistant from Zanzibar. " * 3},
        {"role": "user", "content": "Weather in Paris? Quokka."},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
}


def normalize(
    args: list[str], body: Any, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "normalize", *args],
        input=body if isinstance(body, str) else json.dumps(body),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _no_content(out: str) -> None:
    for word in SECRET_WORDS:
        assert word not in out


def test_prints_zones_keys_identity_without_content(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"policy: round_robin\nnormalizer:\n  mode: tokenizer\n  tokenizer_dir: {tiny_model_dir}\n"
    )
    proc = normalize(["--policy", str(policy), "--tenant", "acme", "--block-size", "8", "--public"], BODY)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"zones", "n_tokens", "block_size", "block_keys", "identity", "diagnostics"}
    assert out["block_size"] == 8 and out["mode"] == "tokenizer"
    assert [z["zone"] for z in out["zones"]] == ["immutable", "append_only"]
    assert len(out["block_keys"]) == out["n_tokens"] // 8
    assert all(isinstance(k, str) and len(k) == 16 for k in out["block_keys"] + out["public_block_keys"])
    assert set(out["identity"]) >= {"model_id", "namespace", "epoch", "adapter", "block_size_tokens"}
    assert "acme" not in proc.stdout and "tiny" not in json.dumps(out["identity"])
    _no_content(proc.stdout)
    # No token ids anywhere: the only integers are counts and spans.
    ints = [v for z in out["zones"] for v in (z["start_token"], z["end_token"])]
    assert all(0 <= v <= out["n_tokens"] for v in ints)
    assert "secret: $KVGATE_KEY_SECRET not set, development secret used" in out["diagnostics"]


def test_same_keys_as_the_library_with_the_same_secret(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "KVGATE_KEY_SECRET": "s3cret"}
    proc = normalize(["--tenant", "t", "--block-size", "4"], BODY, env)
    assert proc.returncode == 0, proc.stderr
    from prompt_normalizer.types import KeyIdentity

    ident = KeyIdentity(model_id="tiny", namespace="t", block_size_tokens=4)
    prompt = Normalizer(NormalizerConfig(), b"s3cret").canonicalize("chat", BODY, ident)
    assert json.loads(proc.stdout)["block_keys"] == [f"{k:016x}" for k in prompt.block_keys]


@pytest.mark.slow
def test_bad_policy_bad_json_bad_request(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("normalizer:\n  tool_order: random\n")
    proc = normalize(["--policy", str(policy)], BODY)
    assert proc.returncode == 2 and "normalizer.tool_order" in proc.stderr
    proc = normalize([], "{not json")
    assert proc.returncode == 2 and "not one JSON request" in proc.stderr
    proc = normalize([], {"messages": [{"role": "user", "content": 3}]})
    assert proc.returncode == 1 and "messages[0].content" in proc.stderr
    proc = normalize([], {"prompt": [1, 2, 3] * 10})
    assert proc.returncode == 0 and json.loads(proc.stdout)["endpoint"] == "completions"


@pytest.fixture
def render_worker(tiny_model_dir: Path) -> Iterator[str]:
    """A loopback worker answering vLLM's chat render endpoint with the tiny model."""
    worker = ChatTemplateTokenizer(str(tiny_model_dir))
    plain = Normalizer(NormalizerConfig(mode="render", canonical_json=False, unicode_nfc=False), b"x")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = plain.prepare_render("chat", body).chat
            assert chat is not None and self.path == "/v1/chat/completions/render"
            ids = worker.encode(worker.render(chat), add_special_tokens=False, with_offsets=False).tokens
            payload = json.dumps({"token_ids": ids.tolist()}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.e2e
def test_render_mode_against_a_loopback_worker(
    render_worker: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    render_policy = tmp_path / "render.yaml"
    render_policy.write_text("normalizer:\n  mode: render\n")
    local_policy = tmp_path / "local.yaml"
    local_policy.write_text(f"normalizer:\n  mode: tokenizer\n  tokenizer_dir: {tiny_model_dir}\n")
    remote = normalize(["--policy", str(render_policy), "--render-url", render_worker], BODY)
    local = normalize(["--policy", str(local_policy)], BODY)
    assert remote.returncode == 0, remote.stderr
    a, b = json.loads(remote.stdout), json.loads(local.stdout)
    assert a["block_keys"] == b["block_keys"] and a["zones"] == b["zones"]
    missing = normalize(["--policy", str(render_policy)], BODY)
    assert missing.returncode == 2 and "render_required" in missing.stderr


def test_a_pools_own_normalizer_comes_from_the_gateway_config(tmp_path: Path) -> None:
    """As `kvgate serve` gives it: the pool's own `normalizer` in the gateway config, else the
    policy file's (a policy file has no per-pool normalizer: its loader refuses one)."""
    from prompt_normalizer.cli import load_config

    policy = tmp_path / "p.yaml"
    policy.write_text("normalizer: {chars_per_token: 3}\n")
    gateway = tmp_path / "gw.yaml"
    gateway.write_text(
        "pools:\n"
        "  - {name: big, models: [m], normalizer: {chars_per_token: 2}}\n"
        "  - {name: small, models: [n]}\n"
    )
    assert load_config(policy).chars_per_token == 3
    assert load_config(policy, "big", gateway).chars_per_token == 2
    assert load_config(policy, "small", gateway).chars_per_token == 3
    assert load_config(None) == NormalizerConfig()
    with pytest.raises(ValueError, match="needs --config"):
        load_config(policy, "big")
    with pytest.raises(ValueError, match="no such pool"):
        load_config(policy, "other", gateway)
    run = normalize(["--policy", str(policy), "--config", str(gateway), "--pool", "big"], BODY)
    assert run.returncode == 0 and json.loads(run.stdout)["mode"] == "approximate"
    missing = normalize(["--policy", str(policy), "--pool", "big"], BODY)
    assert missing.returncode == 2 and "bad config: --pool needs --config" in missing.stderr


@pytest.mark.slow
def test_render_url_must_be_loopback_and_reachable(tmp_path: Path) -> None:
    policy = tmp_path / "render.yaml"
    policy.write_text("normalizer: {mode: render}\n")
    remote = normalize(["--policy", str(policy), "--render-url", "http://10.0.0.1:1"], BODY)
    assert remote.returncode == 1 and "loopback" in remote.stderr
    port = free_port()
    down = normalize(["--policy", str(policy), "--render-url", f"http://127.0.0.1:{port}"], BODY)
    assert down.returncode == 1 and "render_failed" in down.stderr and "Traceback" not in down.stderr
