"""Markers that follow the tree: every test under `tests/e2e/` is `e2e`. Tests elsewhere that start
real processes, or that take seconds on their own, carry `e2e` or `slow` where they are defined.

    pytest -m "not e2e and not slow"     # the fast subset
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
MARKED_FOLDERS = {"e2e": pytest.mark.e2e}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        mark = MARKED_FOLDERS.get(folder)
        if mark is not None:
            item.add_marker(mark)
