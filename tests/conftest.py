"""Markers that follow the tree: every test under `tests/e2e/` is `e2e`. Tests elsewhere that start
real processes, or that take seconds on their own, carry `e2e` or `slow` where they are defined.

    pytest -m "not e2e and not slow"     # the fast subset

`make test` runs the suite on two processes (pytest-xdist); each takes its own ports
(`KVGATE_PORT_SHARD`, loadtest/ports.py), inherited by every process its tests start.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
MARKED_FOLDERS = {"e2e": pytest.mark.e2e}


def pytest_configure(config: pytest.Config) -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count:
        os.environ["KVGATE_PORT_SHARD"] = f"{worker[2:]}/{count}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        mark = MARKED_FOLDERS.get(folder)
        if mark is not None:
            item.add_marker(mark)
