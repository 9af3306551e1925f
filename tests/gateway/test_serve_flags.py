"""`kvgate serve` refuses a flag its mode would ignore: the demo's flags without `--demo`, and
`--secret-file` without `--hash-key`. Ignored, `--secret-file` with `--config` ended the start on
the very secret it named ("KVGATE_KEY_SECRET is not set"). Every case ends before anything is
served (no secret in the environment, so a flag that slipped through would stop there instead)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CONFIG = """\
pools:
  - {name: p, models: [m], workers: ["http://127.0.0.1:1"]}
tenants:
  - {name: t, api_key_hashes: ["hmac-sha256:%s"]}
""" % ("ab" * 32)
SECRET = "s" * 40


def serve(*argv: str, secret: str | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_KEY_SECRET"}
    if secret is not None:
        env["KVGATE_KEY_SECRET"] = secret
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", *argv],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "gw.yaml"
    path.write_text(CONFIG)
    return path


@pytest.mark.parametrize(
    "flags", [["--workers", "3"], ["--pd", "1:1"], ["--pd-protocol", "sglang"], ["--demo-key", "sk-x"]]
)
def test_a_demo_flag_with_a_config_is_refused_by_name(config: Path, flags: list[str]) -> None:
    proc = serve("--config", str(config), *flags)
    assert proc.returncode == 2, proc.stderr
    assert f"kvgate serve: {flags[0]}: only with --demo" in proc.stderr, proc.stderr
    assert "KVGATE_KEY_SECRET" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_secret_file_with_a_config_is_refused_and_says_where_the_secret_goes(
    config: Path, tmp_path: Path
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    proc = serve("--config", str(config), "--secret-file", str(secret_file))
    assert proc.returncode == 2, proc.stderr
    assert "kvgate serve: --secret-file: only with --hash-key" in proc.stderr, proc.stderr
    assert "secrets.key_hash_secret_file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_hash_key_still_takes_its_secret_file_and_refuses_demo_flags(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    from_file = serve("--hash-key", "--secret-file", str(secret_file), stdin="sk-a\n")
    from_env = serve("--hash-key", secret=SECRET, stdin="sk-a\n")
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout.startswith("hmac-sha256:")
    assert from_file.stdout == from_env.stdout

    refused = serve("--hash-key", "--demo-key", "sk-x", secret=SECRET, stdin="sk-a\n")
    assert refused.returncode == 2
    assert "kvgate serve: --demo-key: only with --demo" in refused.stderr


def test_hash_key_warns_of_a_short_key_and_still_hashes_it() -> None:
    short = serve("--hash-key", secret=SECRET, stdin="sk-a\n")
    assert short.returncode == 0, short.stderr
    assert short.stdout.startswith("hmac-sha256:")
    assert "warning: the key is 4 characters" in short.stderr
    assert "openssl rand -hex 32" in short.stderr
    assert "sk-a" not in short.stderr

    long = serve("--hash-key", secret=SECRET, stdin="k" * 32 + "\n")
    assert long.returncode == 0, long.stderr
    assert long.stderr == ""


def test_hash_key_refuses_a_reserved_key() -> None:
    refused = serve("--hash-key", secret=SECRET, stdin="kvgate:sync_batches\n")
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert "keys beginning with 'kvgate:' are reserved" in refused.stderr
