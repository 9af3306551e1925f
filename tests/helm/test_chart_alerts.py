"""The optional PrometheusRule names only metrics and labels the gateway exports, scoped to the
release's scrape job; and the optional PodMonitor scrapes every process's metrics port."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python
import pytest

from gateway.metrics import GatewayMetrics
from tests.helm.chart import CHART, render, validate_strictly
from tests.helm.test_dashboard import exported_series, metric_names

ALERTS = {
    "KvgateTargetDown",
    "KvgateSyncDisconnected",
    "KvgateNoHealthyWorker",
    "KvgateWorkerBreakerOpen",
    "KvgateClientConnectionLimit",
    "KvgateQueueRefusals",
    "KvgateDiscoveryErrors",
    "KvgateKvEventsStale",
    "KvgateAnswerBudgetRefusals",
    "KvgatePolicyReloadFailing",
}
# Labels Prometheus (through the operator's ServiceMonitor or PodMonitor) adds to every target.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "container", "service", "endpoint"}


def _family_labels() -> dict[str, set[str]]:
    """Label names of every gateway family, by each series name Prometheus stores for it."""
    labels: dict[str, set[str]] = {}
    for family in vars(GatewayMetrics()).values():
        name = getattr(family, "name", None) or getattr(family, "_name", None)
        names = getattr(family, "labelnames", None) or getattr(family, "_labelnames", None) or ()
        if isinstance(name, str):
            for suffix in ("", "_total", "_bucket", "_count", "_sum"):
                labels[name + suffix] = set(names)
    return labels


def _rules(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (group,) = render(values)["PrometheusRule/rel-kvgate"]["spec"]["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


ON = {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}}


def test_off_by_default() -> None:
    docs = render()
    assert not any(k.startswith(("PrometheusRule/", "PodMonitor/")) for k in docs)


def test_every_alert_names_exported_metrics_and_labels() -> None:
    rules = _rules(ON)
    assert set(rules) == ALERTS
    exported, labels = exported_series(), _family_labels()
    # Prometheus's own series of each target it scrapes: the release's job, each target at 0.
    assert rules.pop("KvgateTargetDown")["expr"] == 'up{namespace="llm", job="rel-kvgate-metrics"} == 0'
    for name, rule in rules.items():
        expr = rule["expr"]
        used = metric_names(expr)
        assert used and used <= exported, (name, used - exported)
        # Every series is this release's: each selector carries the job of the chart's ServiceMonitor.
        selectors = re.findall(r"(kvgate_\w+)\{([^}]*)\}", expr)
        assert {m for m, _ in selectors} == used
        for metric, matchers in selectors:
            assert 'namespace="llm", job="rel-kvgate-metrics"' in matchers, name
            for label in re.findall(r"(\w+)\s*=", matchers):
                assert label in labels[metric] | TARGET_LABELS, (name, metric, label)
        for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
            for label in (x.strip() for x in clause.split(",")):
                assert any(label in labels[m] for m in used) or label in TARGET_LABELS, (name, label)
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_selector_alert_labels_disabled_and_extra_rules() -> None:
    extra = {"alert": "Mine", "expr": "vector(1)"}
    rules = _rules(
        {
            "podMonitor": {"enabled": True},
            "sync": {"enabled": False},
            "replicaCount": 1,
            "prometheusRule": {
                "enabled": True,
                "alertLabels": {"team": "llm"},
                "disabled": ["KvgateKvEventsStale"],
                "breakerOpenFor": "30m",
                "extraRules": [extra],
            },
        }
    )
    # No sync, no sync alert; the PodMonitor's job is <namespace>/<name>.
    assert set(rules) == ALERTS - {"KvgateSyncDisconnected", "KvgateKvEventsStale"} | {"Mine"}
    assert 'job="llm/rel-kvgate"' in rules["KvgateNoHealthyWorker"]["expr"]
    assert "[30m]" in rules["KvgateWorkerBreakerOpen"]["expr"]
    assert rules["KvgateNoHealthyWorker"]["labels"] == {"team": "llm", "severity": "critical"}
    assert rules["Mine"] == extra
    assert rules["KvgateTargetDown"]["expr"] == 'up{namespace="llm", job="llm/rel-kvgate"} == 0'
    own = _rules({"prometheusRule": {"enabled": True, "selector": 'cluster="a", job="gw"'}})
    assert 'kvgate_worker_healthy{cluster="a", job="gw"}' in own["KvgateNoHealthyWorker"]["expr"]
    assert own["KvgateTargetDown"]["expr"] == 'up{cluster="a", job="gw"} == 0'


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"prometheusRule": {"enabled": True}}, "set prometheusRule.selector"),
        ({"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}, "not both"),
        ({"prometheusRule": {"enabled": True, "disabled": ["KvgateTypo"]}}, "/prometheusRule/disabled/0"),
    ],
)
def test_bad_monitoring_values_fail(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm_python.HelmError, match=needle):
        render(values)


def test_pod_monitor_scrapes_every_process() -> None:
    docs = render({"podMonitor": {"enabled": True, "labels": {"release": "prom"}}, "processes": 2})
    monitor = docs["PodMonitor/rel-kvgate"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics", "metrics-1"]
    pod_labels = docs["Deployment/rel-kvgate"]["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "Service/rel-kvgate-metrics" not in docs  # the PodMonitor needs no Service
    validate_strictly(docs)


def test_every_alert_can_be_disabled_by_name() -> None:
    """The schema's enum of prometheusRule.disabled is the alerts' names: one missing there could
    not be turned off, and each name it lists leaves its alert out."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["prometheusRule"]["properties"]["disabled"]["items"]["enum"]
    rules = _rules(ON)  # sync is on by default: every alert renders
    assert sorted(enum) == sorted(rules)
    for name in enum:
        assert name not in _rules(ON | {"prometheusRule": ON["prometheusRule"] | {"disabled": [name]}})


def test_the_docs_alert_table_lists_every_alert() -> None:
    text = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    section = text[text.index("\n## Alerts\n") : text.index("\n## ", text.index("\n## Alerts\n") + 1)]
    assert set(re.findall(r"^\| `(Kvgate\w+)`", section, re.M)) == ALERTS
