"""docs/deploy.md agrees with the chart: the resource names it gives (`<fullname>-...`) are the
ones a release named as in its examples gets, its install steps make the namespace, and the
IPv6-only listen values it gives render a config the gateway accepts."""

from __future__ import annotations

import re
from typing import Any

import helm_python
import yaml

from gateway.config import parse_config
from tests.helm.chart import CHART, REQUIRED, gateway_config, render

DOC = CHART.parents[1] / "docs" / "deploy.md"
# Everything the chart can create at once (the dashboard elsewhere makes a name of its own).
EVERYTHING: dict[str, Any] = REQUIRED | {
    "keyHashSecret": {"value": "k" * 40},
    "serviceMonitor": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "kubernetesDiscovery": {"enabled": True, "namespaces": ["llm"]},
}


def names_of_release(release: str, values: dict[str, Any] | None = None) -> set[str]:
    out = helm_python.Chart.load(str(CHART)).render(
        EVERYTHING | (values or {}), name=release, namespace="llm", is_install=True
    )
    return {
        doc["metadata"]["name"]
        for path, text in out.items()
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    }


def test_the_documented_resource_names_are_the_charts() -> None:
    """The examples install the release `kvgate`, whose fullname is `kvgate` (not kvgate-kvgate):
    the docs name resources `<fullname>-...`, not `<release>-kvgate-...`."""
    text = DOC.read_text()
    # Once only: where `<fullname>` is defined.
    assert text.count("<release>-kvgate") == 1
    assert "`<fullname>` is the name the chart gives its resources: `<release>-kvgate`" in text
    documented = set(re.findall(r"`(?:<release namespace>\.)?<fullname>(-[a-z-]+)?`", text))
    assert {"", "-config", "-nats", "-metrics", "-policy", "-key-hash"} <= documented
    # The Secret of a given sync token instead of the generated one's.
    rendered = names_of_release("kvgate") | names_of_release(
        "kvgate", {"sync": {"auth": {"token": "a1" * 20}}}
    )
    for suffix in documented:
        assert f"kvgate{suffix}" in rendered, (suffix, sorted(rendered))


def test_the_install_steps_make_the_namespace() -> None:
    commands = re.findall(r"helm install [^\n`]*", DOC.read_text())
    assert commands
    assert all("--create-namespace" in command for command in commands), commands


def test_the_ipv6_listen_values_render_a_config_the_gateway_accepts() -> None:
    found = re.search(r"IPv6-only cluster[^`]*`config: (\{.*?\}\}\})`", DOC.read_text())
    assert found is not None
    config = parse_config(gateway_config(render({"config": yaml.safe_load(found.group(1))})))
    assert config.listen.host == "::" and config.metrics.listen.host == "::"
    assert (config.listen.port, config.metrics.listen.port) == (8080, 9464)
