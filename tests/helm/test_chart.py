"""The Helm chart: rendered and linted with the Helm SDK (no helm binary, no cluster), then every
built-in resource validated against the Kubernetes schemas with unknown fields rejected.
The optional resources are tested in test_chart_resources.py, the example values files and the
values schema in test_chart_values_files.py."""

from __future__ import annotations

import base64
import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from gateway.auth import hash_api_key
from gateway.config import EXIT_MARGIN_S, parse_config
from gateway.sync.broker import LocalBroker
from tests.helm.chart import (
    CHART,
    IMAGE,
    KEY_HASH,
    KEY_HASH_FILE,
    POOL,
    REQUIRED,
    TENANT,
    gateway_config,
    gateway_config_text,
    pod_spec,
    render,
    render_raw,
    validate_strictly,
    values_file,
)
from tests.support.processes import free_port, start_gateway, started
from tests.support.wait import wait_until_sync


def test_lint_is_clean() -> None:
    result = helm_python.lint(str(CHART), REQUIRED, strict=True, kube_version="v1.30.0")
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (
            {"pools": [POOL], "keyHashSecret": REQUIRED["keyHashSecret"], "image": IMAGE},
            "at least one tenant",
        ),
        (
            {"tenants": [TENANT], "keyHashSecret": REQUIRED["keyHashSecret"], "image": IMAGE},
            "set exactly one of workers.urls",
        ),
        ({"pools": [POOL], "tenants": [TENANT], "image": IMAGE}, "keyHashSecret: set existingSecret"),
        (
            {"pools": [POOL], "tenants": [TENANT], "keyHashSecret": REQUIRED["keyHashSecret"]},
            r'image.repository "kvgate" names no registry: the nodes would pull docker.io/library/kvgate',
        ),
    ],
)
def test_install_without_tenant_or_workers_fails_clearly(values: dict[str, Any], needle: str) -> None:
    chart = helm_python.Chart.load(str(CHART))
    with pytest.raises(helm_python.HelmError, match=needle):
        chart.render(values, name="rel", namespace="llm", is_install=True)


def test_rendered_gateway_config_is_accepted_by_the_gateway() -> None:
    docs = render(FULL_VALUES | {"config": {"upstream": {"max_connections": 512}}})
    config = parse_config(gateway_config(docs))
    assert config.listen.port == 8080 and config.listen.host == "0.0.0.0"
    # Metrics on their own port, reachable by Prometheus in the pod's network, never on the client port.
    assert config.metrics.listen.port == 9464 and config.metrics.listen.host == "0.0.0.0"
    assert config.pools[0].workers == ["http://10.0.0.7:8000"]
    assert config.tenants[0].quotas.rpm == 60 and config.tenants[0].isolation == "public"
    assert config.secrets.key_hash_secret_file == KEY_HASH_FILE
    assert config.drain.deadline_s == 120 and config.upstream.max_connections == 512
    assert config.policy_file == "/etc/kvgate/policy/policy.yaml"


FULL_VALUES: dict[str, Any] = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "podDisruptionBudget": {"enabled": True},
    "extraEnv": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4317"}],
    "tenants": [{"name": "team-a", "isolation": "public", "apiKeyHashes": [KEY_HASH], "rpm": 60}],
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


@pytest.mark.parametrize("values", [{}, FULL_VALUES], ids=["defaults", "everything-on"])
def test_every_resource_validates_strictly(values: dict[str, Any]) -> None:
    docs = render(values)
    kinds = {d["kind"] for d in docs.values()}
    assert {"Deployment", "Service", "Secret", "ConfigMap", "ServiceAccount"} <= kinds
    validate_strictly(docs)


def test_validation_would_catch_a_broken_manifest() -> None:
    deployment = render()["Deployment/rel-kvgate"]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)


def test_probes_shutdown_and_mounts() -> None:
    docs = render({"shutdown": {"preStopSleepSeconds": 10, "drainSeconds": 60}})
    spec = pod_spec(docs)
    (c,) = spec["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 10
    # The grace period covers preStop + the gateway's drain deadline + its exit margin (10 s) + 5 s.
    assert spec["terminationGracePeriodSeconds"] == 85
    assert gateway_config(docs)["drain"] == {"deadline_s": 60, "shutdown_delay_s": 0}
    assert c["args"] == ["serve", "--config", "/etc/kvgate/config/gateway.yaml"]
    assert all("subPath" not in m for m in c["volumeMounts"])  # ConfigMap updates must reach the pod
    assert gateway_config(docs)["policy_file"] == "/etc/kvgate/policy/policy.yaml"
    assert "env" not in c  # the key-hash secret is a mounted file, nothing else needs the environment
    explicit = pod_spec(render({"shutdown": {"terminationGracePeriodSeconds": 300}}))
    assert explicit["terminationGracePeriodSeconds"] == 300
    # The deadline the gateway runs with, when `config` sets it: 5 + 120 + 15.
    docs = render({"config": {"drain": {"deadline_s": 119.5}}})
    assert gateway_config(docs)["drain"]["deadline_s"] == 119.5
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 140


def test_the_default_drain_lets_long_generations_finish() -> None:
    """120 s of drain by default (the gateway's own default is 30 s), and a grace period to cover it;
    the examples whose routes allow 600 s requests drain as long."""
    docs = render()
    assert gateway_config(docs)["drain"]["deadline_s"] == 120
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 140  # 5 + 120 + 10 + 5
    for name in ("kubernetes-values.yaml", "dns-values.yaml"):
        docs = render_raw(values_file(name))
        assert gateway_config(docs)["drain"]["deadline_s"] == 600
        assert pod_spec(docs)["terminationGracePeriodSeconds"] == 620


def test_a_grace_period_shorter_than_the_drain_fails_clearly() -> None:
    with pytest.raises(helm_python.HelmError, match=r"must be at least .* \(135\)"):
        render({"shutdown": {"terminationGracePeriodSeconds": 134}})  # 5 + 120 + 10 needed
    assert (
        pod_spec(render({"shutdown": {"terminationGracePeriodSeconds": 135}}))[
            "terminationGracePeriodSeconds"
        ]
        == 135
    )
    with pytest.raises(helm_python.HelmError, match="must be at least"):
        render({"shutdown": {"terminationGracePeriodSeconds": 60}, "config": {"drain": {"deadline_s": 50}}})


def test_a_longer_pre_stop_for_a_cloud_load_balancer_lengthens_the_grace_period() -> None:
    """Behind a cloud load balancer (AWS NLB/ALB, GCP NEGs) the pod leaves its targets well after
    it leaves the endpoints: preStopSleepSeconds keeps it serving meanwhile, before SIGTERM, and
    the grace period adds it to what the gateway takes after the signal (the drain deadline and
    its exit margin, gateway/config)."""
    docs = render({"shutdown": {"preStopSleepSeconds": 60}})
    validate_strictly(docs)
    assert pod_spec(docs)["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": 60}}
    assert gateway_config(docs)["drain"] == {"deadline_s": 120, "shutdown_delay_s": 0}
    needed = 60 + 120 + int(EXIT_MARGIN_S)
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == needed + 5
    with pytest.raises(helm_python.HelmError, match=rf"must be at least .* \({needed}\)"):
        render({"shutdown": {"preStopSleepSeconds": 60, "terminationGracePeriodSeconds": needed - 1}})
    explicit = {"preStopSleepSeconds": 60, "terminationGracePeriodSeconds": needed}
    assert pod_spec(render({"shutdown": explicit}))["terminationGracePeriodSeconds"] == needed


@pytest.mark.parametrize(
    "values",
    [
        {"shutdown": {"shutdownDelaySeconds": 120}},
        {"shutdown": {"shutdownDelaySeconds": 300}},  # AWS's default deregistration delay
        {"config": {"drain": {"deadline_s": 50, "shutdown_delay_s": 60}}},
        {"config": {"drain": {"deadline_s": 50}}, "shutdown": {"shutdownDelaySeconds": 50}},
    ],
)
def test_a_shutdown_delay_as_long_as_the_drain_fails_clearly(values: dict[str, Any]) -> None:
    """The gateway counts both its shutdown delay and its drain deadline from SIGTERM
    (gateway/server.py): a delay of the whole deadline would leave it listening until the deadline
    and then end everything in flight at once. The render fails and points at the preStop sleep."""
    with pytest.raises(
        helm_python.HelmError,
        match=r"shutdownDelaySeconds \(.*\) must be below the drain deadline .*preStopSleepSeconds",
    ):
        render(values)


def test_a_shutdown_delay_within_the_drain_renders() -> None:
    docs = render({"shutdown": {"shutdownDelaySeconds": 30}})
    assert gateway_config(docs)["drain"] == {"deadline_s": 120, "shutdown_delay_s": 30}
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 140  # the delay is within the deadline
    overridden = {"config": {"drain": {"deadline_s": 300, "shutdown_delay_s": 0}}}
    docs = render(overridden | {"shutdown": {"shutdownDelaySeconds": 150}})
    assert gateway_config(docs)["drain"]["shutdown_delay_s"] == 0
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 320


def test_config_change_rolls_pods_but_policy_change_does_not() -> None:
    def annotations(values: dict[str, Any]) -> dict[str, str]:
        ann: dict[str, str] = render(values)["Deployment/rel-kvgate"]["spec"]["template"]["metadata"][
            "annotations"
        ]
        return ann

    base = annotations({})
    assert annotations({"logLevel": "debug"})["checksum/config"] != base["checksum/config"]
    assert annotations({"tenants": [TENANT | {"rpm": 5}]})["checksum/config"] != base["checksum/config"]
    assert annotations({"policy": {"content": "policy: least_load\n"}}) == base
    rolled = annotations({"policy": {"rollOnChange": True, "content": "policy: least_load\n"}})
    assert "checksum/policy" in rolled


def test_static_urls_and_dns_workers() -> None:
    static = render(
        {"pools": [{"name": "p", "models": ["m"], "workers": {"urls": ["http://10.0.0.1:8000"]}}]}
    )
    assert gateway_config(static)["pools"] == [
        {"name": "p", "models": ["m"], "workers": ["http://10.0.0.1:8000"]}
    ]
    dns_pool = {
        "name": "p",
        "models": ["m"],
        "workers": {"dns": {"name": "vllm.llm.svc", "port": 8000, "refreshSeconds": 3}},
        "kvEventsEndpoint": "tcp://{host}:5557",
    }
    rendered = gateway_config(render({"pools": [dns_pool]}))
    (pool,) = rendered["pools"]
    assert pool["dns"] == {"name": "vllm.llm.svc", "port": 8000, "scheme": "http", "refresh_s": 3}
    assert "workers" not in pool
    assert pool["kv_events_endpoint"] == "tcp://{host}:5557"
    # `kvgate serve` accepts both keys.
    parsed = parse_config(rendered).pools[0]
    assert parsed.dns is not None and parsed.kv_events_endpoint == "tcp://{host}:5557"


def test_policy_configmap_and_overrides() -> None:
    docs = render(
        {"policy": {"content": "policy: least_load\nseed: 4\n"}, "config": {"log_level": "warning"}}
    )
    policy = yaml.safe_load(docs["ConfigMap/rel-kvgate-policy"]["data"]["policy.yaml"])
    assert policy == {"policy": "least_load", "seed": 4}
    assert gateway_config(docs)["log_level"] == "warning"


def test_optional_resources() -> None:
    assert not any(k.startswith("ServiceMonitor/") for k in render())
    assert "PodDisruptionBudget/rel-kvgate" not in render({"podDisruptionBudget": {"enabled": False}})
    assert "Service/rel-kvgate-metrics" not in render()
    docs = render(FULL_VALUES)
    sm = docs["ServiceMonitor/rel-kvgate"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    # The ServiceMonitor selects only the metrics Service; the client Service has no metrics port.
    selector = sm["spec"]["selector"]["matchLabels"]
    metrics_svc = docs["Service/rel-kvgate-metrics"]
    assert selector.items() <= metrics_svc["metadata"]["labels"].items()
    assert not selector.items() <= docs["Service/rel-kvgate"]["metadata"]["labels"].items()
    assert metrics_svc["spec"]["clusterIP"] == "None"
    # Scraped while not ready (starting, draining); clients only ever reach ready pods.
    assert metrics_svc["spec"]["publishNotReadyAddresses"] is True
    assert "publishNotReadyAddresses" not in docs["Service/rel-kvgate"]["spec"]
    assert metrics_svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9464, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert [p["name"] for p in docs["Service/rel-kvgate"]["spec"]["ports"]] == ["http"]
    (c,) = pod_spec(docs)["containers"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in c["ports"]
    assert docs["PodDisruptionBudget/rel-kvgate"]["spec"]["maxUnavailable"] == 1
    tenant = gateway_config(docs)["tenants"][0]
    assert tenant == {
        "name": "team-a",
        "isolation": "public",
        "api_key_hashes": [KEY_HASH],
        "quotas": {"rpm": 60},
    }


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"pools": [{"name": "p", "models": ["m"], "workers": {"urls": []}}]}, "exactly one of workers.urls"),
        (
            {"pools": [POOL | {"workers": {"urls": ["http://x:1"], "dns": {"name": "w", "port": 1}}}]},
            "exactly one of workers.urls",
        ),
        (
            {"pools": [POOL | {"workers": {"dns": {"port": 80}}}]},
            "/pools/0/workers/dns': missing property 'name'",
        ),
        ({"pools": [{"name": "p", "workers": {"urls": ["http://x:1"]}}]}, "models is required"),
        ({"policy": {"content": ""}}, "policy.content is required"),
        ({"tenants": [{"name": "t"}]}, "apiKeyHashes is required"),
    ],
)
def test_bad_values_fail_with_a_clear_message(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm_python.HelmError, match=needle):
        render(values)


@pytest.mark.e2e
def test_rendered_config_and_policy_boot_a_real_gateway(tmp_path: Path) -> None:
    """The chart's config Secret, policy ConfigMap and key-hash file, written to disk, run
    `kvgate serve` and route a chat request; the gateway joins the sync broker the config names (a
    real nats-server that admits only the token of the chart's Secret)."""
    secret, api_key = "chart-test-key-hash-secret-of-32-bytes", "sk-chart-test"
    backend_port, gateway_port, metrics_port = free_port(), free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    sync_token = "c0ffee" * 8
    broker = LocalBroker(free_port(), tmp_path, token=sync_token)
    token_path = tmp_path / "sync-token"
    policy_path = tmp_path / "policy.yaml"
    # The file the pod mounts from the key-hash Secret; the environment carries a wrong secret,
    # so the request below is admitted only if the gateway keyed its hashes from the file.
    key_hash_path = tmp_path / "key-hash"
    key_hash_path.write_text(secret + "\n")
    values = {
        "tenants": [{"name": "team-a", "apiKeyHashes": [hash_api_key(secret.encode(), api_key)]}],
        "pools": [{"name": "p", "models": ["bench-model"], "workers": {"urls": [backend_url]}}],
        "policy": {"content": "policy: cost\nseed: 1\n"},
        "sync": {"url": broker.url, "auth": {"token": sync_token}},
        # Only what a pod's filesystem and network provide differently here.
        "config": {
            "policy_file": str(policy_path),
            "sync": {"auth": {"token_file": str(token_path)}},
            "secrets": {"key_hash_secret_file": str(key_hash_path)},
            "listen": {"host": "127.0.0.1", "port": gateway_port},
            "metrics": {"listen": {"host": "127.0.0.1", "port": metrics_port}},
        },
    }
    docs = render(values)
    assert gateway_config(docs)["secrets"] == {"key_hash_secret_file": str(key_hash_path)}
    policy_path.write_text(docs["ConfigMap/rel-kvgate-policy"]["data"]["policy.yaml"])
    token_path.write_bytes(base64.b64decode(docs["Secret/rel-kvgate-sync-token-given"]["data"]["token"]))
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(gateway_config_text(docs))
    argv = [sys.executable, "-m", "loadtest.static_backend", "--port", str(backend_port)]
    backend = started(argv, backend_url + "/health")
    gateway = None
    try:
        broker.start()
        gateway = start_gateway(
            config_path, gateway_port, secret=b"not-the-key-hash-secret", port_from_config=True
        )
        base = f"http://127.0.0.1:{gateway_port}"
        body = json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["choices"][0]["message"]["content"] == "ok"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            assert b"kvgate_requests_total" in resp.read()
        wait_until_sync(
            lambda: re.search(
                rb"^kvgate_sync_connected 1(\.0)?$", _get(f"http://127.0.0.1:{metrics_port}/metrics"), re.M
            ),
            20,
            "the gateway connected to the sync broker",
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/metrics", timeout=10)
        assert info.value.code == 404
    finally:
        if gateway is not None:
            gateway.stop()
        backend.stop()
        broker.stop()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: bytes = resp.read()
        return body
