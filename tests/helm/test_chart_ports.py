"""Ports the schema takes one by one but that cannot go together: a broker whose client and
monitoring ports are one (nats-server would not start), and metrics ports past 65535 (process i
serves /metrics on metrics.port + i, and the API server refuses a port past 65535)."""

from __future__ import annotations

import helm_python
import pytest

from tests.helm.chart import RELEASE, container, render


def test_the_brokers_two_ports_must_differ() -> None:
    with pytest.raises(
        helm_python.HelmError, match=r"sync\.nats\.port and sync\.nats\.monitorPort are both 8222"
    ):
        render({"sync": {"nats": {"port": 8222}}})
    with pytest.raises(helm_python.HelmError, match="are both 4222"):
        render({"sync": {"nats": {"monitorPort": 4222}}})
    docs = render({"sync": {"nats": {"port": 4223, "monitorPort": 8223}}})
    conf = docs[f"ConfigMap/{RELEASE}-kvgate-nats"]["data"]["nats-server.conf"]
    assert "port: 4223" in conf and "http_port: 8223" in conf
    # An external broker: the chart runs none, its ports are not the chart's to check.
    render({"sync": {"url": "nats://nats.messaging.svc:4222", "nats": {"port": 8222}}})


def test_metrics_ports_past_65535_fail_the_install() -> None:
    with pytest.raises(
        helm_python.HelmError, match=r"metrics\.port 65535 \+ processes 2 - 1 is past port 65535"
    ):
        render({"metrics": {"port": 65535}, "processes": 2})
    ports = [
        p["containerPort"] for p in container(render({"metrics": {"port": 65534}, "processes": 2}))["ports"]
    ]
    assert ports[1:] == [65534, 65535]
    render({"metrics": {"port": 65535}})
