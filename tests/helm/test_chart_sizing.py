"""The gateway pod's resources follow `processes`: one core and one memory budget per process
(values.yaml, `resources`), derived when `resources` is left empty, and a note at install when
resources set by hand fall short of them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.chart import container, notes, render, validate_strictly

GIB = 1024**3


def resources(values: dict[str, Any]) -> dict[str, Any]:
    docs = render(values)
    validate_strictly(docs)
    got: dict[str, Any] = container(docs)["resources"]
    return got


@pytest.mark.parametrize(
    ("processes", "cpu", "memory", "limit"),
    [(1, "1", "512Mi", "1Gi"), (2, "2", "1Gi", "2Gi"), (4, "4", "2Gi", "4Gi")],
)
def test_default_resources_scale_with_processes(processes: int, cpu: str, memory: str, limit: str) -> None:
    assert resources({"processes": processes}) == {
        "requests": {"cpu": cpu, "memory": memory},
        "limits": {"memory": limit},
    }
    assert "below" not in notes({"processes": processes})


def test_the_default_memory_limit_follows_the_answer_budget() -> None:
    """Per process: limits.max_buffered_answer_bytes of whole answers held, plus 512Mi for the rest."""
    config = {"limits": {"max_buffered_answer_bytes": GIB}}
    assert resources({"processes": 2, "config": config})["limits"] == {"memory": "3Gi"}
    config = {"limits": {"max_buffered_answer_bytes": 100 * 1024 * 1024 + 1}}
    assert resources({"config": config})["limits"] == {"memory": "613Mi"}


def test_resources_set_by_hand_are_kept_and_a_shortfall_is_noted() -> None:
    short = {"requests": {"cpu": "1500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert resources({"processes": 4, "resources": short}) == short
    text = notes({"processes": 4, "resources": short})
    assert "resources.requests.cpu (1500m) is below processes (4)" in text
    assert "resources.limits.memory (2Gi) is below 4 x 1Gi" in text
    enough = {"requests": {"cpu": 4, "memory": "2Gi"}, "limits": {"memory": 4 * GIB}}
    assert "below" not in notes({"processes": 4, "resources": enough})
    # Without a memory limit nothing is killed for it; a CPU limit alone is the request too.
    unlimited = {"limits": {"cpu": "4"}}
    assert resources({"processes": 4, "resources": unlimited}) == unlimited
    assert "below" not in notes({"processes": 4, "resources": unlimited})
