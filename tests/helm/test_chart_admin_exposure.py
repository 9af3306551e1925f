"""The admin API is served on the client port (gateway/app.py): an Ingress or HTTPRoute in front of
the Service that routes `/` must not take `/admin` out with the client API. An HTTPRoute answers
`/admin` from a rule without a backend; an Ingress, which cannot leave a path out, is refused."""

from __future__ import annotations

import re
from typing import Any

import helm_python
import pytest

from tests.gateway.test_docs_endpoints import served_paths
from tests.helm.chart import KEY_HASH, RELEASE, render

ADMIN = {"config": {"admin": {"api_key_hash": KEY_HASH}}}
ROUTE = {"enabled": True, "parentRefs": [{"name": "shared-gateway"}]}
# Served on the client port but not for clients: the admin API and the kubelet's probes (also on
# the metrics port, where the probes go); /metrics is on the metrics port only.
NOT_FOR_CLIENTS = {"/admin", "/healthz", "/readyz", "/metrics"}


def client_prefixes() -> set[str]:
    """The first path segment of every client route the gateway serves."""
    return {"/" + path.split("/")[1] for path in served_paths()} - NOT_FOR_CLIENTS


def prefix_paths(prefixes: set[str]) -> list[dict[str, Any]]:
    return [{"path": prefix, "pathType": "Prefix"} for prefix in sorted(prefixes)]


def ingress(values: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = render(values)[f"Ingress/{RELEASE}-kvgate"]
    return doc


def route_rules(values: dict[str, Any]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = render(values)[f"HTTPRoute/{RELEASE}-kvgate"]["spec"]["rules"]
    return rules


def test_an_ingress_of_slash_is_refused_with_the_admin_api_on() -> None:
    with pytest.raises(helm_python.HelmError, match=r"would take the admin API \(/admin") as refused:
        render(ADMIN | {"ingress": {"enabled": True}})
    # The message lists the prefixes to use instead: every first segment the client API serves.
    listed = re.search(r"pathType Prefix: ([^(]*) \(docs/deploy.md", str(refused.value))
    assert listed is not None, refused.value
    assert set(listed.group(1).split(", ")) == client_prefixes()
    for path_type in ("Prefix", "ImplementationSpecific"):
        with pytest.raises(helm_python.HelmError, match="admin API"):
            hosts = [
                {
                    "host": "llm.example.com",
                    "paths": [{"path": "/v1", "pathType": "Prefix"}, {"path": "/", "pathType": path_type}],
                }
            ]
            render(ADMIN | {"ingress": {"enabled": True, "hosts": hosts}})


def test_an_ingress_of_the_client_prefixes_renders_with_the_admin_api_on() -> None:
    hosts = [{"host": "llm.example.com", "paths": prefix_paths(client_prefixes())}]
    (rule,) = ingress(ADMIN | {"ingress": {"enabled": True, "hosts": hosts}})["spec"]["rules"]
    assert {p["path"] for p in rule["http"]["paths"]} == client_prefixes()
    # An exact `/` takes nothing else, and without the admin API `/` is the default.
    exact = [{"host": "llm.example.com", "paths": [{"path": "/", "pathType": "Exact"}]}]
    assert ingress(ADMIN | {"ingress": {"enabled": True, "hosts": exact}})
    (rule,) = ingress({"ingress": {"enabled": True}})["spec"]["rules"]
    assert [p["path"] for p in rule["http"]["paths"]] == ["/"]


def test_an_httproute_of_slash_answers_admin_without_a_backend() -> None:
    rules = route_rules(ADMIN | {"httpRoute": ROUTE})
    # A rule without backendRefs: the Gateway API has it answered 500; its longer prefix wins.
    assert rules[0] == {"matches": [{"path": {"type": "PathPrefix", "value": "/admin"}}]}
    assert rules[1]["backendRefs"] == [{"name": f"{RELEASE}-kvgate", "port": 8080}]
    # No matches, or a match without a path, mean PathPrefix `/` too.
    for matches in ([], [{"headers": [{"name": "x-team", "value": "a"}]}]):
        assert "backendRefs" not in route_rules(ADMIN | {"httpRoute": ROUTE | {"matches": matches}})[0]
    # A config of one's own may turn the admin API on unseen by the chart.
    own = {"configSecret": {"existingSecret": "own-config"}, "tenants": []}
    assert "backendRefs" not in route_rules(own | {"httpRoute": ROUTE})[0]


def test_an_httproute_needs_no_admin_rule_when_admin_is_off_or_not_routed() -> None:
    (only,) = route_rules({"httpRoute": ROUTE})
    assert "backendRefs" in only
    v1 = [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    (only,) = route_rules(ADMIN | {"httpRoute": ROUTE | {"matches": v1}})
    assert only["matches"] == v1
