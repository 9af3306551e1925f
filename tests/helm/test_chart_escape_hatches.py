"""The chart's escape hatches: a pinned image digest, a PriorityClass, the Deployment strategy,
the Service's traffic policy and source ranges, init and sidecar containers, and labels on every
resource. Each is off (empty) by default, or the chart's own (the strategy), and validates
strictly when set."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.helm.chart import container, pod_spec, render, validate_strictly

DIGEST = "sha256:" + "0123456789abcdef" * 4
SIDECAR = {"name": "proxy", "image": "envoyproxy/envoy:v1.31.0", "ports": [{"containerPort": 9901}]}
INIT = {"name": "warm", "image": "busybox:1.36", "command": ["true"]}


def test_defaults_render_none_of_them() -> None:
    docs = render()
    spec = pod_spec(docs)
    assert "priorityClassName" not in spec and "initContainers" not in spec
    assert [c["name"] for c in spec["containers"]] == ["kvgate"]
    assert container(docs)["image"] == "registry.example.com/llm/kvgate:0.1.0"
    # A rollout never takes a serving pod down before its replacement is ready.
    assert docs["Deployment/rel-kvgate"]["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
    }
    service = docs["Service/rel-kvgate"]["spec"]
    assert "externalTrafficPolicy" not in service and "loadBalancerSourceRanges" not in service


def test_the_brokers_image_may_be_pinned_by_digest_too() -> None:
    def broker_image(docs: dict[str, Any]) -> str:
        image: str = docs["Deployment/rel-kvgate-nats"]["spec"]["template"]["spec"]["containers"][0]["image"]
        return image

    assert broker_image(render()) == "nats:2.15.1-alpine"
    pinned = render({"sync": {"nats": {"image": {"digest": DIGEST}}}})
    assert broker_image(pinned) == f"nats@{DIGEST}"
    validate_strictly(pinned)
    with pytest.raises(helm_python.HelmValuesError, match="/sync/nats/image/digest"):
        render({"sync": {"nats": {"image": {"digest": "latest"}}}})


def test_an_image_without_a_registry_is_refused_unless_local() -> None:
    """`kvgate` alone would be pulled as docker.io/library/kvgate (ImagePullBackOff): the install
    fails instead, unless the image is loaded into the nodes (kind, minikube)."""
    with pytest.raises(helm_python.HelmError, match=r"image.repository \"kvgate\" names no registry"):
        render({"image": {"repository": "kvgate"}})
    local = render({"image": {"repository": "kvgate", "local": True, "pullPolicy": "Never"}})
    assert container(local)["image"] == "kvgate:0.1.0"
    assert container(local)["imagePullPolicy"] == "Never"
    validate_strictly(local)
    for repository in ("localhost:5000/kvgate", "ghcr.io/acme/kvgate", "acme/kvgate"):
        assert container(render({"image": {"repository": repository}}))["image"] == f"{repository}:0.1.0"


def test_every_escape_hatch() -> None:
    docs = render(
        {
            "image": {"repository": "registry.example.com/kvgate", "tag": "ignored", "digest": DIGEST},
            "priorityClassName": "inference-critical",
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "service": {
                "type": "LoadBalancer",
                "port": 8080,
                "externalTrafficPolicy": "Local",
                "loadBalancerSourceRanges": ["10.0.0.0/8"],
            },
            "initContainers": [INIT],
            "extraContainers": [SIDECAR],
            "commonLabels": {"team": "llm", "cost-center": "42"},
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True},
        }
    )
    spec = pod_spec(docs)
    assert spec["containers"][0]["image"] == f"registry.example.com/kvgate@{DIGEST}"
    assert spec["priorityClassName"] == "inference-critical"
    assert spec["initContainers"] == [INIT]
    assert spec["containers"][1] == SIDECAR
    assert docs["Deployment/rel-kvgate"]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    # A strategy of one's own replaces the chart's whole (Recreate takes no rollingUpdate).
    recreate = render({"strategy": {"type": "Recreate"}})
    assert recreate["Deployment/rel-kvgate"]["spec"]["strategy"] == {"type": "Recreate"}
    validate_strictly(recreate)
    service = docs["Service/rel-kvgate"]["spec"]
    assert service["externalTrafficPolicy"] == "Local"
    assert service["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    for key, doc in docs.items():
        assert doc["metadata"]["labels"]["team"] == "llm", key
    # Selectors never change: the Deployment's stays the two immutable labels.
    assert set(docs["Deployment/rel-kvgate"]["spec"]["selector"]["matchLabels"]) == {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
    }
    validate_strictly(docs)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"image": {"repository": "x", "digest": "abc"}}, "/image/digest"),
        (
            {"service": {"type": "ClusterIP", "port": 8080, "externalTrafficPolicy": "Nearest"}},
            "externalTrafficPolicy",
        ),
        ({"priorityClassName": 5}, "/priorityClassName"),
    ],
)
def test_bad_escape_hatch_values_fail(values: dict[str, object], needle: str) -> None:
    with pytest.raises(helm_python.HelmError, match=needle):
        render(values)
