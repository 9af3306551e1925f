"""Every query of the chart's Grafana dashboard names only metrics the gateway exports.

The exported names come from the gateway's own metrics registry (gateway/metrics/catalogue.py), expanded by
metric type into the series names Prometheus stores (`_total`, `_bucket`, ...)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from gateway.metrics import GatewayMetrics
from tests.helm.chart import CHART

# Series names Prometheus stores for each family type (OpenMetrics exposition).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
)
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported_series() -> set[str]:
    names: set[str] = set()
    for family in GatewayMetrics().registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label
    matchers, ranges, grouping clauses, function calls and keywords are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    text = re.sub(r"\b\d[\w.]*", " ", text)  # numbers and durations (1e3, 5m, 1h30m)
    names = set()
    for match in _IDENT.finditer(text):
        rest = text[match.end() :].lstrip()
        word = match.group()
        if rest.startswith("(") or word in _KEYWORDS or word in ("Inf", "NaN"):
            continue
        names.add(word)
    return names


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            yield f"variable {variable['name']!r}", inner.group(1) if inner else query


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads((CHART / "dashboards" / "kvgate.json").read_text())
    exported = exported_series()
    queries = list(_queries(dashboard))
    assert len(queries) >= 15
    unknown = []
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        unknown.extend(f"{where}: {name}" for name in sorted(names - exported))
    assert unknown == []


def test_the_dashboard_covers_the_request_metrics() -> None:
    dashboard = json.loads((CHART / "dashboards" / "kvgate.json").read_text())
    used = set().union(*(metric_names(expr) for _, expr in _queries(dashboard)))
    for name in (
        "kvgate_requests_total",
        "kvgate_time_to_first_token_seconds_bucket",
        "kvgate_cached_prompt_tokens_total",
        "kvgate_worker_healthy",
        "kvgate_request_time_per_output_token_seconds_bucket",
        "kvgate_worker_requests_total",
        "kvgate_worker_breaker_state",
        "kvgate_policy_events_total",
        "kvgate_kv_events_lag_seconds",
        "process_cpu_seconds_total",
    ):
        assert name in used


def test_the_extractor_sees_through_promql() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, model) "
        '(rate(kvgate_ttft_bucket{model=~"$model"}[$__rate_interval])))'
        " / on (model) group_left sum without (tenant) (kvgate_x_total offset 5m) > bool 1e3"
    )
    assert metric_names(expr) == {"kvgate_ttft_bucket", "kvgate_x_total"}
    assert metric_names('sum(rate(not_exported_total{a="b"}[5m]))') == {"not_exported_total"}
    assert "kvgate_requests_total" in exported_series()
    assert "kvgate_requests" not in exported_series()  # a counter is stored with its suffix


def test_a_worker_seen_by_several_gateway_processes_counts_once() -> None:
    # Every gateway process (and replica) exports the same worker's state: the panels take one
    # value per worker before counting or summing (a plain sum showed 4 routable workers for 2
    # behind `--processes 2`).
    dashboard = json.loads((CHART / "dashboards" / "kvgate.json").read_text())
    per_worker = ("kvgate_worker_healthy", "kvgate_worker_kv_cache_usage", "kvgate_worker_requests_waiting")
    for where, expr in _queries(dashboard):
        for name in per_worker:
            if name in expr:
                assert f"max by (pool, worker) ({name})" in expr, f"{where}: {expr}"
