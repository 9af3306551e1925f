"""A disruption budget's maxUnavailable: a count of pods (0 or more) or a percentage of them up to
100 %, else the API server refuses the PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.helm.chart import RELEASE, render, validate_strictly


@pytest.mark.parametrize("bad", ["abc", "50", "-1%", -1, 1.5, "101%", "150%"])
def test_a_disruption_budget_neither_a_count_nor_a_percentage_fails_the_install(bad: Any) -> None:
    with pytest.raises(helm_python.HelmError, match="/podDisruptionBudget/maxUnavailable"):
        render({"podDisruptionBudget": {"maxUnavailable": bad}})


@pytest.mark.parametrize("good", [0, 1, 3, "0%", "25%", "100%"])
def test_a_disruption_budget_of_pods_or_a_percentage_renders(good: Any) -> None:
    docs = render({"podDisruptionBudget": {"maxUnavailable": good}})
    assert docs[f"PodDisruptionBudget/{RELEASE}-kvgate"]["spec"]["maxUnavailable"] == good
    validate_strictly(docs)
