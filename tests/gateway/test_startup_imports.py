"""An approximate-mode start-up (the demo's) loads none of the optional extras' packages.

The base install has no tokenizers, jinja2 or matplotlib; if start-up imported them, `kvgate
serve --demo` would fail on a plain `pip install kvgate`. The test builds, in a fresh interpreter,
everything the demo builds before it listens (the gateway's config, policy, state and app, and
the emulated worker's app) and lists the optional modules that got imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prompt_normalizer.extras import TOKENIZER_PACKAGES

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL_MODULES = (*TOKENIZER_PACKAGES, "matplotlib")

_DEMO_STARTUP = """
import argparse

import gateway.cli, gateway.serve, gateway.server  # what `kvgate serve --demo` loads first
from gateway.app import build_app
from gateway.auth import hash_api_key
from gateway.demo import demo_config, demo_policy
from gateway.precise import install_token_hasher
from gateway.state import build_state

secret = b"s" * 32
config = demo_config(["http://127.0.0.1:9"], hash_api_key(secret, "sk-demo"), "127.0.0.1", 0)
policy = demo_policy()
state = build_state(config, secret, policy.policy, policy.config.normalizer)
install_token_hasher(state, policy.policy)
build_app(state, None)
assert policy.config.normalizer.mode == "approximate"

from loadtest.emulator.app import create_app
from loadtest.emulator.cli import add_arguments, config_from_args
from loadtest.emulator.kv_events import publisher_factory

parser = argparse.ArgumentParser()
add_arguments(parser)
worker = config_from_args(parser.parse_args(["--port", "9", "--model", "kvgate-demo"]))
create_app(worker, publisher_factory(worker))
"""


def _imported_after(script: str) -> list[str]:
    """The optional modules a fresh interpreter holds after running `script`."""
    probe = (
        f"\nimport json, sys\nprint(json.dumps(sorted(m for m in {OPTIONAL_MODULES!r} if m in sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script + probe], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    imported: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return imported


def test_demo_startup_imports_no_optional_package() -> None:
    assert _imported_after(_DEMO_STARTUP) == []


@pytest.mark.parametrize("module", OPTIONAL_MODULES)
def test_the_check_sees_an_optional_import(module: str) -> None:
    # The same probe does report a package once something imports it (so an empty list above
    # means "not imported", not "not looked for").
    assert _imported_after(f"import {module}") == [module]


def test_tokenizer_mode_without_its_packages_stops_at_config_load(tmp_path: Path) -> None:
    config = {
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "workers": ["http://127.0.0.1:1"],
                "normalizer": {"mode": "tokenizer", "tokenizer_dir": str(tmp_path)},
            }
        ],
        "tenants": [{"name": "t", "api_key_hashes": ["hmac-sha256:" + "0" * 64]}],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    # A None entry in sys.modules makes the import fail as if the package were not installed.
    script = (
        "import sys\n"
        "sys.modules['tokenizers'] = None\n"
        "from gateway.cli import main\n"
        f"sys.exit(main(['serve', '--config', {str(path)!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "mode 'tokenizer' needs tokenizers: pip install 'kvgate[tokenizer]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "api_key_hashes" not in proc.stderr  # the one error is the missing package
