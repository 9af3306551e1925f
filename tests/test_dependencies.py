"""pyproject.toml declares exactly the third-party packages kvgate's code imports.

Every top-level module that gateway/, policies/, prompt_normalizer/ or loadtest/ imports, and that
is neither standard library nor kvgate's own, must belong to a distribution listed in
`dependencies` or in an install extra other than `dev` (the test tools); and every distribution
listed there must be imported somewhere, so nothing is installed for nothing. Modules map to
distributions through the installed metadata (`yaml` is PyYAML, `zmq` is pyzmq).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections import defaultdict
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("gateway", "policies", "prompt_normalizer", "loadtest")
OWN_MODULES = {*SOURCE_PACKAGES, "tests"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, requirement
    return _canonical(match.group(1))


def declared() -> dict[str, str]:
    """Declared distribution -> where: "dependencies" or the extra's name (self-references left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    where = {_requirement_name(r): "dependencies" for r in project["dependencies"]}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        if extra != "dev":
            where.update({_requirement_name(r): extra for r in requirements})
    where.pop(_canonical(project["name"]), None)
    return where


def imported_modules() -> dict[str, set[str]]:
    """Third-party top-level module -> the source files that import it."""
    found: dict[str, set[str]] = defaultdict(set)
    for package in SOURCE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN_MODULES:
                        found[top].add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _distributions_by_module() -> dict[str, set[str]]:
    return {m: {_canonical(d) for d in dists} for m, dists in metadata.packages_distributions().items()}


def test_the_walk_finds_the_imports() -> None:
    modules = imported_modules()
    assert "gateway/server.py" in modules["uvicorn"]
    assert "loadtest/report/plots.py" in modules["matplotlib"]  # imported inside a function
    assert not OWN_MODULES & modules.keys()
    assert "json" not in modules


def test_every_imported_package_is_declared() -> None:
    wanted = declared()
    distributions = _distributions_by_module()
    undeclared = {
        module: sorted(files)
        for module, files in imported_modules().items()
        if not distributions.get(module, set()) & wanted.keys()
    }
    assert undeclared == {}, "imported but not in pyproject.toml (module: files)"


def test_every_declared_package_is_imported() -> None:
    distributions = _distributions_by_module()
    used = set().union(*(distributions.get(m, set()) for m in imported_modules()))
    unused = sorted(set(declared()) - used)
    assert unused == [], "declared in pyproject.toml but imported nowhere"
