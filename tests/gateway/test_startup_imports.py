"""An approximate-mode start-up (the demo's) loads none of the optional extras' packages.

The base install has no tokenizers, jinja2, matplotlib or OpenTelemetry SDK; if start-up imported
them, `kvgate serve --demo` would fail on a plain `pip install kvgate`. Each test runs a real start-up in a
fresh interpreter whose uvicorn server, once it listens, prints the optional modules loaded so
far and exits: the demo gateway (which starts and stops its emulated worker by PID) and the
emulated worker itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prompt_normalizer.extras import TOKENIZER_PACKAGES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL_MODULES = (*TOKENIZER_PACKAGES, "matplotlib", "opentelemetry.sdk")
_MARK = "optional modules loaded:"

# Prepended to each start-up: report at the end of uvicorn's startup, then ask it to exit.
_REPORT_WHEN_LISTENING = f"""
import json, sys, uvicorn

_startup = uvicorn.Server.startup

async def _report_and_exit(self, sockets=None):
    await _startup(self, sockets)
    loaded = sorted(m for m in {OPTIONAL_MODULES!r} if m in sys.modules)
    print({_MARK!r}, json.dumps(loaded), flush=True)
    self.should_exit = True

uvicorn.Server.startup = _report_and_exit
"""

_DEMO = """
from gateway.cli import main
argv = ["serve", "--demo", "--workers", "1", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
sys.exit(main(argv))
"""

_WORKER = """
import runpy
sys.argv = ["emulator", "--host", "127.0.0.1", "--port", "0", "--model", "kvgate-demo"]
runpy.run_module("loadtest.emulator", run_name="__main__")
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=90
    )


def _loaded_at_startup(startup: str) -> list[str]:
    proc = _run(_REPORT_WHEN_LISTENING + startup)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    assert len(lines) == 1, proc.stdout
    loaded: list[str] = json.loads(lines[0].removeprefix(_MARK))
    return loaded


@pytest.mark.parametrize("startup", [_DEMO, _WORKER], ids=["demo-gateway", "emulated-worker"])
def test_startup_loads_no_optional_package(startup: str) -> None:
    assert _loaded_at_startup(startup) == []


@pytest.mark.parametrize("module", OPTIONAL_MODULES)
def test_the_report_sees_an_optional_import(module: str) -> None:
    # The same report does list a package that start-up imported (so an empty list above means
    # "not imported", not "not looked for").
    assert _loaded_at_startup(f"import {module}\n" + _WORKER) == [module]


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
    proc = _run(script)
    assert proc.returncode == 2, proc.stderr
    assert "mode 'tokenizer' needs tokenizers: pip install 'kvgate[tokenizer]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "api_key_hashes" not in proc.stderr  # the one error is the missing package
