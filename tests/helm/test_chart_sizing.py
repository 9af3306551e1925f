"""The gateway pod's resources follow `processes`: one core and one memory budget per process
(values.yaml, `resources`), derived by the chart with `resources` merged over them key by key, and
a note at install when values set by hand fall short of them."""

from __future__ import annotations

from typing import Any

import helm_python
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
    # A CPU limit alone is the request too.
    assert "below" not in notes({"processes": 4, "resources": {"limits": {"cpu": "4"}}})


@pytest.mark.parametrize(
    ("given", "rendered"),
    [
        (
            {"limits": {"memory": "2Gi"}},
            {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        ),
        (
            {"requests": {"cpu": "2", "memory": "1Gi"}},
            {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
        ),
        (
            {"requests": {"cpu": "3"}},
            {"requests": {"cpu": "3", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        ),
        (
            {"limits": {"cpu": "4"}},
            {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"cpu": "4", "memory": "1Gi"}},
        ),
    ],
)
def test_resources_set_in_part_are_merged_over_the_derived_ones(
    given: dict[str, Any], rendered: dict[str, Any]
) -> None:
    """Each key set replaces its derived value and the others stay: overriding the memory limit
    keeps the CPU request (which a CPU-utilization autoscaler measures against), overriding the
    requests keeps the memory limit."""
    assert resources({"resources": given}) == rendered
    assert resources({"resources": given, "autoscaling": {"enabled": True}}) == rendered


def test_a_derived_value_never_contradicts_one_set_by_hand() -> None:
    """Kubernetes refuses a request above its limit: a derived request yields to a lower limit set by
    hand, a derived limit to a higher request (and the notes say what falls short)."""
    low = {"processes": 4, "resources": {"limits": {"cpu": "2", "memory": "1Gi"}}}
    assert resources(low) == {
        "requests": {"cpu": "2", "memory": "1Gi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    }
    text = notes(low)
    assert "resources.limits.cpu (2) is below processes (4)" in text
    assert "resources.limits.memory (1Gi) is below 4 x 1Gi" in text
    high = {"resources": {"requests": {"memory": "4Gi"}}}
    assert resources(high) == {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    assert "below" not in notes(high)


def test_null_removes_a_derived_value() -> None:
    assert resources({"resources": {"requests": {"cpu": None}}}) == {
        "requests": {"memory": "512Mi"},
        "limits": {"memory": "1Gi"},
    }
    assert "resources.requests.cpu is null" in notes({"resources": {"requests": {"cpu": None}}})
    assert resources({"resources": {"limits": None}}) == {"requests": {"cpu": "1", "memory": "512Mi"}}
    assert resources({"resources": {"requests": None, "limits": {"memory": None}}}) == {}


def test_autoscaling_on_utilization_needs_the_request_it_measures() -> None:
    """Without a CPU request a CPU-utilization autoscaler computes nothing and never scales: the
    render fails, naming the fix. A limit alone is the request too."""
    no_cpu = {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}
    with pytest.raises(
        helm_python.HelmError, match=r"targetCPUUtilizationPercentage needs a cpu request.*unset"
    ):
        render(no_cpu)
    assert (
        resources(no_cpu | {"resources": {"requests": {"cpu": None}, "limits": {"cpu": "2"}}})["limits"][
            "cpu"
        ]
        == "2"
    )
    # Without the autoscaler, or scaling on memory only, no CPU request is needed.
    assert "cpu" not in resources({"resources": {"requests": {"cpu": None}}})["requests"]
    on_memory = {
        "enabled": True,
        "targetCPUUtilizationPercentage": None,
        "targetMemoryUtilizationPercentage": 80,
    }
    assert "cpu" not in resources(no_cpu | {"autoscaling": on_memory})["requests"]
    no_memory = {"requests": {"memory": None}, "limits": {"memory": None}}
    with pytest.raises(
        helm_python.HelmError, match=r"targetMemoryUtilizationPercentage needs a memory request"
    ):
        render({"autoscaling": on_memory, "resources": no_memory})


def _utilization(
    kind: str, name: str, target_type: str = "Utilization", container: str = "kvgate"
) -> dict[str, Any]:
    """An autoscaling/v2 metric of `kind` (Resource or ContainerResource) on `name`."""
    target = {"type": target_type} | (
        {"averageUtilization": 70} if target_type == "Utilization" else {"averageValue": "500m"}
    )
    if kind == "Resource":
        return {"type": "Resource", "resource": {"name": name, "target": target}}
    return {
        "type": "ContainerResource",
        "containerResource": {"name": name, "container": container, "target": target},
    }


@pytest.mark.parametrize("kind", ["Resource", "ContainerResource"])
@pytest.mark.parametrize("name", ["cpu", "memory"])
def test_a_utilization_metric_of_ones_own_needs_the_request_too(kind: str, name: str) -> None:
    """autoscaling.metrics measured as a utilization of the gateway's CPU (memory) need its request
    as much as the chart's own targets do: without it the render fails, naming the metric."""
    autoscaling = {
        "enabled": True,
        "targetCPUUtilizationPercentage": None,
        "metrics": [_utilization(kind, name)],
    }
    missing = {"requests": {name: None}, "limits": {name: None}}
    with pytest.raises(
        helm_python.HelmError,
        match=rf"autoscaling\.metrics\[0\] \({kind} {name}, target\.type Utilization\) needs a {name} "
        rf"request, and resources\.requests\.{name} is null.*AverageValue",
    ):
        render({"autoscaling": autoscaling, "resources": missing})
    # With the request (derived, or a limit alone), the metric renders as given.
    docs = render({"autoscaling": autoscaling})
    validate_strictly(docs)
    assert docs["HorizontalPodAutoscaler/rel-kvgate"]["spec"]["metrics"] == autoscaling["metrics"]
    render(
        {
            "autoscaling": autoscaling,
            "resources": {"requests": {name: None}, "limits": {name: "2" if name == "cpu" else "2Gi"}},
        }
    )
    # An AverageValue target, or another container's utilization, needs no request of the gateway.
    for metric in (
        _utilization(kind, name, "AverageValue"),
        _utilization("ContainerResource", name, container="proxy"),
    ):
        render({"autoscaling": autoscaling | {"metrics": [metric]}, "resources": missing})
