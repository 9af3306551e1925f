"""pyproject.toml declares exactly the third-party packages kvgate imports.

Every third-party module that gateway/, policies/, prompt_normalizer/ or loadtest/ imports must
belong to a distribution listed in `dependencies` or in an install extra other than `dev` (the
test tools), and every distribution listed there must be imported somewhere, so nothing is
installed for nothing. The tests' own imports may also use the `dev` extra.

A module belongs to the distributions whose installed files hold it, matched on the longest dotted
prefix any of them holds: `yaml` is PyYAML, and in the `opentelemetry` namespace
`opentelemetry.trace` is opentelemetry-api while `opentelemetry.sdk.trace` is opentelemetry-sdk.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections import defaultdict
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("gateway", "policies", "prompt_normalizer", "loadtest")
OWN_MODULES = {*SOURCE_PACKAGES, "tests"}
_MODULE_SUFFIXES = (".py", ".so", ".pyd")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, requirement
    return _canonical(match.group(1))


def declared(*, dev: bool) -> dict[str, str]:
    """Declared distribution -> "dependencies" or its extra (the `dev` extra only if asked; the
    project's references to its own extras left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    where = {_requirement_name(r): "dependencies" for r in project["dependencies"]}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        if dev or extra != "dev":
            where.update({_requirement_name(r): extra for r in requirements})
    where.pop(_canonical(project["name"]), None)
    return where


@functools.cache
def imported_modules(*folders: str) -> dict[str, set[str]]:
    """Third-party dotted name -> the files under `folders` that import it (read-only: cached)."""
    found: dict[str, set[str]] = defaultdict(set)
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from opentelemetry import trace` imports the module opentelemetry.trace;
                    # for a plain name the owner lookup falls back to the module.
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN_MODULES:
                        found[name].add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _owners() -> dict[str, frozenset[str]]:
    """Dotted module or package name -> the installed distributions whose files hold it."""
    owners: dict[str, set[str]] = defaultdict(set)
    for dist in metadata.distributions():
        name = _canonical(dist.metadata["Name"])
        for file in dist.files or ():
            path = PurePosixPath(str(file))
            if path.suffix not in _MODULE_SUFFIXES or ".." in path.parts:
                continue
            parts = [*path.parts[:-1], path.name.split(".")[0]]
            if any(not part.isidentifier() for part in parts):  # dist-info, bin/, data files
                continue
            for i in range(1, len(parts) + 1):
                owners[".".join(parts[:i])].add(name)
    return {module: frozenset(names) for module, names in owners.items()}


def distributions_of(module: str) -> frozenset[str]:
    """The distributions holding `module` (its longest dotted prefix that any of them holds)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        names = _owners().get(".".join(parts[:i]))
        if names:
            return names
    return frozenset()


def _undeclared(modules: dict[str, set[str]], wanted: dict[str, str]) -> dict[str, list[str]]:
    """Top-level name -> files, for each imported name no declared distribution holds."""
    out: dict[str, set[str]] = defaultdict(set)
    for module, files in modules.items():
        if not distributions_of(module) & wanted.keys():
            out[module.partition(".")[0]] |= files
    return {top: sorted(files) for top, files in out.items()}


def test_modules_map_to_their_distributions() -> None:
    assert distributions_of("yaml") == {"pyyaml"}
    assert distributions_of("zmq.asyncio") == {"pyzmq"}
    assert distributions_of("opentelemetry.trace") == {"opentelemetry-api"}
    assert distributions_of("opentelemetry.sdk.trace.export") == {"opentelemetry-sdk"}


def test_the_walk_finds_the_imports() -> None:
    modules = imported_modules(*SOURCE_PACKAGES)
    assert "gateway/server.py" in modules["uvicorn"]
    assert "loadtest/report/plots.py" in modules["matplotlib"]  # imported inside a function
    assert "gateway/tracing.py" in modules["opentelemetry.trace"]  # from opentelemetry import trace
    assert not any(m.partition(".")[0] in OWN_MODULES for m in modules)
    assert "json" not in modules


def test_every_package_the_code_imports_is_declared() -> None:
    undeclared = _undeclared(imported_modules(*SOURCE_PACKAGES), declared(dev=False))
    assert undeclared == {}, "imported but not in pyproject.toml's dependencies or extras"


def test_every_package_the_tests_import_is_declared() -> None:
    undeclared = _undeclared(imported_modules("tests"), declared(dev=True))
    assert undeclared == {}, "imported by the tests but not in pyproject.toml"


def test_every_declared_package_is_imported() -> None:
    used = set().union(*(distributions_of(m) for m in imported_modules(*SOURCE_PACKAGES)))
    unused = sorted(set(declared(dev=False)) - used)
    assert unused == [], "declared in pyproject.toml but imported nowhere"
