"""`policy_reload_interval_s` is used within bounds, and docs/config.md says which and what
happens to a value outside them (it used to be clamped without a word anywhere an operator reads)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.policy_watch import MAX_INTERVAL_S, MIN_INTERVAL_S, PolicyWatcher
from tests.gateway.test_policy_watch import Swaps

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


@pytest.mark.parametrize(
    ("asked_s", "used_s"),
    [(0.001, MIN_INTERVAL_S), (MIN_INTERVAL_S, MIN_INTERVAL_S), (2.0, 2.0), (3600.0, MAX_INTERVAL_S)],
)
def test_the_interval_is_taken_within_its_bounds(policy_file: Path, asked_s: float, used_s: float) -> None:
    assert PolicyWatcher(policy_file, Swaps(), interval_s=asked_s)._interval_s == used_s


def test_the_config_reference_states_the_bounds() -> None:
    row = next(
        line for line in DOC.read_text().splitlines() if line.startswith("| `policy_reload_interval_s` |")
    )
    assert f"within {MIN_INTERVAL_S:g}–{MAX_INTERVAL_S:g} s" in row, row
    assert re.search(r"outside is taken as the nearest bound", row), row
