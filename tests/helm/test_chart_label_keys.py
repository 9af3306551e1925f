"""Labels the schema used to accept that clash with the ones the chart sets itself: a duplicate key
in the manifest, which Helm cannot parse, or pod labels other than the Deployment's selector."""

from __future__ import annotations

import helm_python
import pytest

from tests.helm.chart import RELEASE, container, nested, pod_spec, render, validate_strictly


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("podLabels", "app.kubernetes.io/instance"),
        ("podLabels", "app.kubernetes.io/name"),
        ("podLabels", "app.kubernetes.io/component"),
        ("sync.nats.podLabels", "app.kubernetes.io/name"),
        ("sync.nats.podLabels", "app.kubernetes.io/part-of"),
        ("commonLabels", "app.kubernetes.io/name"),
        ("commonLabels", "app.kubernetes.io/version"),
        ("commonLabels", "helm.sh/chart"),
    ],
)
def test_labels_that_would_clash_with_the_charts_own_fail_the_install(path: str, key: str) -> None:
    """The chart writes these keys itself: a second one in the same labels is a duplicate key Helm
    cannot parse, and a pod label other than its selector's would leave the Deployment selecting
    no pod."""
    with pytest.raises(helm_python.HelmError, match="/" + path.replace(".", "/")):
        render(nested(path, {key: "other"}))


def test_labels_of_ones_own_still_render() -> None:
    docs = render(
        {
            "podLabels": {"app.kubernetes.io/version": "canary", "team": "llm"},
            "commonLabels": {"tier": "inference", "team": "llm"},
            "sync": {"nats": {"podLabels": {"team": "llm"}}},
        }
    )
    labels = docs[f"Deployment/{RELEASE}-kvgate"]["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "llm" and labels["app.kubernetes.io/version"] == "canary"
    assert container(docs)["name"] == "kvgate" and pod_spec(docs)["containers"]
    validate_strictly(docs)


@pytest.mark.parametrize("path", ["podAnnotations", "sync.nats.podAnnotations"])
def test_the_charts_checksum_annotations_cannot_be_given(path: str) -> None:
    """The chart writes checksum/* on the pods itself (a changed config rolls them): one given in
    podAnnotations would be a duplicate key Helm cannot parse, or stand for nothing."""
    with pytest.raises(helm_python.HelmError, match="/" + path.replace(".", "/") + "/checksum~1config"):
        render(nested(path, {"checksum/config": "abc"}))
    docs = render(nested(path, {"example.com/owner": "llm"}))
    name = f"{RELEASE}-kvgate-nats" if path.startswith("sync") else f"{RELEASE}-kvgate"
    annotations = docs[f"Deployment/{name}"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["example.com/owner"] == "llm" and "checksum/config" in annotations
