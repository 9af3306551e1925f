"""The chart's example values files (helm/kvgate/ci/: static pool, DNS pool, Kubernetes discovery,
replica sync, prefill/decode pools) render, lint and validate strictly; and values.schema.json
rejects a misspelt key by name."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python
import pytest
import yaml

from gateway.config import parse_config
from policies.config import parse_policy_yaml
from tests.helm.chart import (
    CHART,
    NAMESPACE,
    REQUIRED,
    container,
    env,
    gateway_config,
    pod_spec,
    render,
    render_raw,
    validate_strictly,
    values_file,
    volumes,
)

FILES = (
    "static-values.yaml",
    "dns-values.yaml",
    "kubernetes-values.yaml",
    "sync-values.yaml",
    "pd-values.yaml",
)
# Which pools of each example find their workers through the API server.
DISCOVERY = {"kubernetes-values.yaml": [True], "pd-values.yaml": [False, True]}


def test_the_example_files_are_the_ones_tested_here() -> None:
    assert sorted(p.name for p in (CHART / "ci").iterdir()) == sorted(FILES)


@pytest.mark.parametrize("name", FILES)
def test_example_renders_lints_and_validates_strictly(name: str) -> None:
    values = values_file(name)
    docs = render_raw(values)
    assert {"Deployment", "Service", "Secret", "ConfigMap", "ServiceAccount"} <= {
        d["kind"] for d in docs.values()
    }
    validate_strictly(docs)
    report = helm_python.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []
    # The policy file the example ships is one the gateway accepts.
    parse_policy_yaml(docs["ConfigMap/rel-kvgate-policy"]["data"]["policy.yaml"])


@pytest.mark.parametrize("name", FILES)
def test_example_gateway_config_is_accepted_by_the_gateway(name: str) -> None:
    config = parse_config(gateway_config(render_raw(values_file(name))))
    assert config.listen.host == "0.0.0.0" and config.policy_file == "/etc/kvgate/policy/policy.yaml"
    discovery = [pool.kubernetes is not None for pool in config.pools]
    assert discovery == DISCOVERY.get(name, [False])
    assert config.sync.url is not None  # every example shares between its replicas


def test_static_example() -> None:
    docs = render_raw(values_file("static-values.yaml"))
    (pool,) = gateway_config(docs)["pools"]
    assert pool["workers"] == ["http://10.0.0.7:8000", "http://10.0.0.8:8000"]
    assert pool["max_in_flight_per_worker"] == 128
    assert volumes(docs)["key-hash"]["secret"]["secretName"] == "kvgate-key-hash"
    assert "Secret/rel-kvgate-key-hash" not in docs  # referenced, not created
    assert pod_spec(docs)["automountServiceAccountToken"] is False
    assert not any(k.startswith(("Role/", "RoleBinding/", "HorizontalPodAutoscaler/")) for k in docs)


def test_dns_example() -> None:
    docs = render_raw(values_file("dns-values.yaml"))
    config = gateway_config(docs)
    (pool,) = config["pools"]
    assert pool["dns"]["name"] == "vllm-headless.llm.svc.cluster.local"
    assert pool["kv_events_endpoint"] == "tcp://{host}:5557"
    assert config["tracing"] == {"enabled": True}
    assert env(docs)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability.svc:4318"
    assert "replicas" not in docs["Deployment/rel-kvgate"]["spec"]  # the HPA owns it
    for kind in ("HorizontalPodAutoscaler", "Ingress", "NetworkPolicy", "ServiceMonitor"):
        assert f"{kind}/rel-kvgate" in docs
    assert "ConfigMap/rel-kvgate-dashboard" in docs
    assert "Secret/rel-kvgate-key-hash" in docs


def test_kubernetes_example() -> None:
    docs = render_raw(values_file("kubernetes-values.yaml"))
    (pool,) = gateway_config(docs)["pools"]
    assert pool["kubernetes"] == {
        "namespace": "inference",
        "selector": {"app.kubernetes.io/name": "vllm", "model": "llama-3-1-8b"},
        "port": 8000,
        "scheme": "http",
    }
    assert pod_spec(docs)["automountServiceAccountToken"] is True
    # The workers' namespace only (no pool watches the release's own), named after the release's.
    assert [k for k in docs if k.startswith("Role")] == [
        "Role/llm.rel-kvgate-discovery@inference",
        "RoleBinding/llm.rel-kvgate-discovery@inference",
    ]
    role = docs["Role/llm.rel-kvgate-discovery@inference"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = docs["RoleBinding/llm.rel-kvgate-discovery@inference"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kvgate", "namespace": NAMESPACE}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    mounts = {m["name"]: m for m in container(docs)["volumeMounts"]}
    assert mounts["tokenizer"]["mountPath"] == "/models/llama"
    route = docs["HTTPRoute/rel-kvgate"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "rel-kvgate", "port": 8080}]


def test_sync_example() -> None:
    docs = render_raw(values_file("sync-values.yaml"))
    config = parse_config(gateway_config(docs))
    assert config.sync.url == f"nats://rel-kvgate-nats.{NAMESPACE}.svc:4222"
    assert config.sync.subject_prefix == "kvgate.prod.llama"
    assert (config.sync.batch_interval_s, config.sync.queue_max_items) == (0.01, 32768)
    assert (config.sync.peer_timeout_s, config.sync.batch_max_items) == (10, 256)  # 256: the default
    assert container(docs)["args"][-4:] == ["--processes", "2", "--watchdog-s", "21"]
    assert container(docs)["resources"]["requests"]["cpu"] == "2"  # a core per process
    assert docs["Deployment/rel-kvgate"]["spec"]["replicas"] == 3
    nats = docs["Deployment/rel-kvgate-nats"]["spec"]["template"]["spec"]["containers"][0]
    assert nats["resources"]["limits"] == {"memory": "256Mi"}
    assert {"NetworkPolicy/rel-kvgate", "NetworkPolicy/rel-kvgate-nats", "Service/rel-kvgate-nats"} <= set(
        docs
    )


def test_pd_example() -> None:
    docs = render_raw(values_file("pd-values.yaml"))
    llama, qwen = parse_config(gateway_config(docs)).pools
    assert llama.pd is not None and llama.pd.protocol == "vllm"
    assert llama.static_roles == {
        "http://10.0.1.11:8000": "prefill",
        "http://10.0.1.12:8000": "prefill",
        "http://10.0.2.11:8000": "decode",
        "http://10.0.2.12:8000": "decode",
    }
    assert llama.workers == [] and llama.pd.transfer.bandwidth_bytes_per_s == 45e9
    assert qwen.pd is not None and qwen.pd.protocol == "sglang" and qwen.pd.bootstrap_port == 8998
    assert qwen.pd.conditional is False
    assert qwen.kubernetes is not None and qwen.kubernetes.role_label == "kvgate.io/role"
    assert "Role/llm.rel-kvgate-discovery@inference" in docs


@pytest.mark.parametrize(
    ("values", "where", "key"),
    [
        ({"replicaCont": 5}, "at ''", "replicaCont"),
        ({"autoscaling": {"enabled": True, "maxReplica": 4}}, "at '/autoscaling'", "maxReplica"),
        (
            {"pools": [REQUIRED["pools"][0] | {"kvEventEndpoint": "tcp://{host}:1"}]},
            "at '/pools/0'",
            "kvEventEndpoint",
        ),
        ({"tracing": {"otlp": {"endpont": "http://x:4318"}}}, "at '/tracing/otlp'", "endpont"),
    ],
)
def test_a_misspelt_key_fails_with_a_schema_error_naming_it(
    values: dict[str, Any], where: str, key: str
) -> None:
    with pytest.raises(helm_python.HelmValuesError) as raised:
        render(values)
    message = str(raised.value)
    assert f"{where}: additional properties '{key}' not allowed" in message
    # `helm lint` reports the same.
    report = helm_python.lint(str(CHART), {**REQUIRED, **values}, strict=True)
    assert any(key in error for error in report["errors"])


def _objects(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if "properties" in node:
            found.append((path, node))
        for key, child in node.items():
            found.extend(_objects(child, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            found.extend(_objects(child, f"{path}/{i}"))
    return found


def test_every_object_of_the_schema_rejects_unknown_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    objects = _objects(schema)
    assert len(objects) > 30
    assert [path for path, node in objects if node.get("additionalProperties") is not False] == []


def test_every_top_level_value_is_in_the_docs_values_table() -> None:
    docs = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    table = docs[docs.index("## Values") : docs.index("## Checking the chart")]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert [key for key in values if f"`{key}" not in table] == []


@pytest.mark.parametrize("name", FILES)
def test_example_pools_with_kv_events_key_prompts_token_exact(name: str) -> None:
    """A pool subscribing to KV events needs a token-exact normalizer (its own or the policy
    file's): with an approximate one the gateway ignores the events, which an example must not
    show as precise routing."""
    docs = render_raw(values_file(name))
    policy = parse_policy_yaml(docs["ConfigMap/rel-kvgate-policy"]["data"]["policy.yaml"])
    for pool in parse_config(gateway_config(docs)).pools:
        if pool.subscribes_kv_events:
            normalizer = pool.normalizer or policy.normalizer
            assert normalizer.mode != "approximate", pool.name


NGINX_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def nginx_size_bytes(size: str) -> int:
    """An nginx size (`client_max_body_size`: a number with an optional k, m or g) in bytes."""
    parsed = re.fullmatch(r"(\d+)([kKmMgG]?)", size)
    assert parsed is not None, size
    return int(parsed.group(1)) * NGINX_SIZE_UNITS[parsed.group(2).lower()]


def test_an_nginx_ingress_lets_through_the_bodies_the_gateway_takes() -> None:
    """ingress-nginx refuses bodies over 1m unless proxy-body-size says otherwise: an example with
    an nginx Ingress lets through what the gateway accepts (limits.max_body_bytes, 8 MiB)."""
    checked = []
    for name in FILES:
        docs = render_raw(values_file(name))
        ingress = docs.get("Ingress/rel-kvgate")
        if ingress is not None and ingress["spec"].get("ingressClassName") == "nginx":
            limit = parse_config(gateway_config(docs)).limits.max_body_bytes
            size = ingress["metadata"]["annotations"].get("nginx.ingress.kubernetes.io/proxy-body-size", "1m")
            assert nginx_size_bytes(size) == limit, (name, size, limit)
            checked.append(name)
    assert checked == ["dns-values.yaml"]
