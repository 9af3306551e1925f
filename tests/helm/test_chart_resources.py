"""The chart's optional resources and settings: secrets, Kubernetes-discovery RBAC, autoscaling,
Ingress and HTTPRoute, NetworkPolicy, tracing, extra volumes and env, the Grafana dashboard."""

from __future__ import annotations

import base64
import json
from typing import Any

import helm_python
import pytest
import yaml

from gateway.config import parse_config
from tests.helm.chart import (
    CHART,
    KEY_HASH,
    POOL,
    TENANT,
    container,
    env,
    gateway_config,
    mounts,
    notes,
    pod_spec,
    render,
    validate_strictly,
    volumes,
)

VALUE = "0123456789abcdef" * 2  # the shortest key-hash secret the chart takes
KUBE_POOL: dict[str, Any] = POOL | {"workers": {"kubernetes": {"selector": {"app": "vllm"}, "port": 8000}}}


def test_default_policy_is_cost() -> None:
    policy = yaml.safe_load(render()["ConfigMap/rel-kvgate-policy"]["data"]["policy.yaml"])
    assert policy["policy"] == "cost"


def test_key_hashes_live_in_a_secret_never_in_a_configmap() -> None:
    docs = render()
    assert KEY_HASH in gateway_config(docs)["tenants"][0]["api_key_hashes"]
    for doc in docs.values():
        if doc["kind"] == "ConfigMap":
            assert KEY_HASH not in json.dumps(doc)
    assert volumes(docs)["config"] == {"name": "config", "secret": {"secretName": "rel-kvgate-config"}}


def test_key_hash_secret_created_from_a_value_or_referenced() -> None:
    docs = render({"keyHashSecret": {"value": VALUE}})
    secret = docs["Secret/rel-kvgate-key-hash"]
    assert base64.b64decode(secret["data"]["secret"]) == VALUE.encode()
    assert volumes(docs)["key-hash"]["secret"]["secretName"] == "rel-kvgate-key-hash"
    annotations = docs["Deployment/rel-kvgate"]["spec"]["template"]["metadata"]["annotations"]
    rotated = render({"keyHashSecret": {"value": VALUE[::-1]}})["Deployment/rel-kvgate"]
    assert (
        rotated["spec"]["template"]["metadata"]["annotations"]["checksum/key-hash"]
        != (annotations["checksum/key-hash"])
    )
    referenced = render({"keyHashSecret": {"existingSecret": "mine"}})
    assert "Secret/rel-kvgate-key-hash" not in referenced
    assert volumes(referenced)["key-hash"]["secret"]["secretName"] == "mine"
    assert (
        "checksum/key-hash"
        not in referenced["Deployment/rel-kvgate"]["spec"]["template"]["metadata"]["annotations"]
    )
    with pytest.raises(helm_python.HelmError, match="either value"):
        render({"keyHashSecret": {"value": VALUE, "existingSecret": "mine"}})


def test_key_hash_secret_is_a_file_never_an_environment_variable() -> None:
    """Not in the pod spec's env (nor the process environment): one key of the Secret, mounted
    read-only, readable by its owner and the pod's fsGroup only, and named in the gateway config."""
    docs = render({"keyHashSecret": {"existingSecret": "mine", "key": "hmac.key", "env": "OLD_NAME"}})
    assert env(docs) == {}
    assert "KVGATE_KEY_SECRET" not in json.dumps(docs["Deployment/rel-kvgate"])
    assert volumes(docs)["key-hash"]["secret"] == {
        "secretName": "mine",
        "defaultMode": 0o440,
        "items": [{"key": "hmac.key", "path": "hmac.key"}],
    }
    assert mounts(docs)["key-hash"] == {
        "name": "key-hash",
        "mountPath": "/etc/kvgate/key-hash",
        "readOnly": True,
    }
    assert pod_spec(docs)["securityContext"]["fsGroup"] == 10001
    assert gateway_config(docs)["secrets"] == {"key_hash_secret_file": "/etc/kvgate/key-hash/hmac.key"}
    validate_strictly(docs)
    # keyHashSecret.env names a variable only for a config of one's own: here, used nowhere.
    assert gateway_config(docs) == gateway_config(
        render({"keyHashSecret": {"existingSecret": "mine", "key": "hmac.key"}})
    )
    with pytest.raises(helm_python.HelmValuesError, match="/keyHashSecret/key"):
        render({"keyHashSecret": {"existingSecret": "mine", "key": "a/b"}})


def test_an_existing_config_secret_replaces_the_generated_one() -> None:
    # Pools and tenants then live in that Secret: the chart needs neither.
    docs = render({"configSecret": {"existingSecret": "gateway-config"}, "tenants": []})
    assert "Secret/rel-kvgate-config" not in docs
    assert volumes(docs)["config"]["secret"]["secretName"] == "gateway-config"
    # A gateway.yaml of one's own may still read the key-hash secret from the environment (the
    # default before it became a file): it is there for such configs only.
    assert env(docs)["KVGATE_KEY_SECRET"]["valueFrom"] == {
        "secretKeyRef": {"name": "rel-kvgate-key-hash", "key": "secret"}
    }
    validate_strictly(docs)
    # A config that reads the mounted file keeps the secret out of the environment: env "".
    own = {"configSecret": {"existingSecret": "gateway-config"}, "tenants": []}
    docs = render(own | {"keyHashSecret": {"existingSecret": "rel-kvgate-key-hash", "env": ""}})
    assert "env" not in container(docs)
    assert volumes(docs)["key-hash"]["secret"]["secretName"] == "rel-kvgate-key-hash"
    validate_strictly(docs)
    assert "KVGATE_KEY_SECRET" not in notes(own | {"keyHashSecret": {"existingSecret": "k", "env": ""}})
    assert "$KVGATE_KEY_SECRET" in notes(own)


def test_kubernetes_pools_need_the_discovery_flag() -> None:
    with pytest.raises(helm_python.HelmError, match=r"needs kubernetesDiscovery\.enabled=true"):
        render({"pools": [KUBE_POOL]})
    with pytest.raises(helm_python.HelmError, match="exactly one of"):
        render(
            {
                "kubernetesDiscovery": {"enabled": True},
                "pools": [POOL | {"workers": KUBE_POOL["workers"] | {"urls": ["http://x:1"]}}],
            }
        )


def test_kubernetes_pool_config_and_rbac() -> None:
    extra = {"kubernetes": {"selector": {"app": "vllm"}, "port": 8000, "extra": {"max_pods": 64}}}
    docs = render({"kubernetesDiscovery": {"enabled": True}, "pools": [POOL | {"workers": extra}]})
    (pool,) = gateway_config(docs)["pools"]
    # The release namespace by default; `extra` keys pass through to the gateway's block.
    assert pool["kubernetes"] == {
        "namespace": "llm",
        "selector": {"app": "vllm"},
        "port": 8000,
        "scheme": "http",
        "max_pods": 64,
    }
    assert [k for k in docs if k.startswith(("Role", "RoleBinding"))] == [
        "Role/rel-kvgate-discovery",
        "RoleBinding/rel-kvgate-discovery",
    ]
    assert pod_spec(docs)["automountServiceAccountToken"] is True
    validate_strictly(docs)
    no_rbac = render(
        {"kubernetesDiscovery": {"enabled": True, "rbac": {"create": False}}, "pools": [KUBE_POOL]}
    )
    assert not any(k.startswith("Role") for k in no_rbac)


@pytest.mark.parametrize(("port", "rendered"), [("http", "http"), ("vllm-serve", "vllm-serve"), (8000, 8000)])
def test_kubernetes_workers_port_may_be_a_container_port_name(port: str | int, rendered: str | int) -> None:
    """The gateway takes a port number or the name of the pods' container port (gateway/k8s/config.py)."""
    workers = {"kubernetes": {"selector": {"app": "vllm"}, "port": port}}
    docs = render({"kubernetesDiscovery": {"enabled": True}, "pools": [POOL | {"workers": workers}]})
    assert gateway_config(docs)["pools"][0]["kubernetes"]["port"] == rendered
    (pool,) = parse_config(gateway_config(docs)).pools
    assert pool.kubernetes is not None and pool.kubernetes.port == rendered


@pytest.mark.parametrize("port", ["Http", "a-very-long-port-name", "-http", "8000", 0, 70000])
def test_a_kubernetes_workers_port_that_is_neither_is_refused(port: str | int) -> None:
    workers = {"kubernetes": {"selector": {"app": "vllm"}, "port": port}}
    with pytest.raises(helm_python.HelmValuesError, match="/workers/kubernetes/port"):
        render({"kubernetesDiscovery": {"enabled": True}, "pools": [POOL | {"workers": workers}]})


def test_autoscaling() -> None:
    docs = render(
        {
            "autoscaling": {
                "enabled": True,
                "minReplicas": 3,
                "maxReplicas": 9,
                "targetMemoryUtilizationPercentage": 80,
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
            }
        }
    )
    hpa = docs["HorizontalPodAutoscaler/rel-kvgate"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "rel-kvgate",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 9)
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu", "memory"]
    assert "replicas" not in docs["Deployment/rel-kvgate"]["spec"]
    validate_strictly(docs)
    assert render()["Deployment/rel-kvgate"]["spec"]["replicas"] == 2
    with pytest.raises(helm_python.HelmError, match="minReplicas must not exceed"):
        render({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}})


def test_the_autoscaler_scales_down_one_pod_a_minute_by_default() -> None:
    """Each pod removed drains its streams and takes what it learned with it: by default the
    autoscaler removes one a minute, after five minutes of lower load; a behavior of one's own is
    merged over it, and null leaves Kubernetes' defaults."""
    hpa = render({"autoscaling": {"enabled": True}})["HorizontalPodAutoscaler/rel-kvgate"]["spec"]
    assert hpa["behavior"] == {
        "scaleDown": {
            "stabilizationWindowSeconds": 300,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        }
    }
    own = {"scaleUp": {"stabilizationWindowSeconds": 0}, "scaleDown": {"stabilizationWindowSeconds": 600}}
    docs = render({"autoscaling": {"enabled": True, "behavior": own}})
    validate_strictly(docs)
    behavior = docs["HorizontalPodAutoscaler/rel-kvgate"]["spec"]["behavior"]
    assert behavior["scaleUp"] == own["scaleUp"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    unset = render({"autoscaling": {"enabled": True, "behavior": None}})
    assert "behavior" not in unset["HorizontalPodAutoscaler/rel-kvgate"]["spec"]


def test_ingress_and_httproute() -> None:
    docs = render(
        {
            "ingress": {"enabled": True, "className": "nginx", "hosts": [{"paths": [{"path": "/v1"}]}]},
            "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "sectionName": "https"}]},
        }
    )
    ingress = docs["Ingress/rel-kvgate"]["spec"]
    assert ingress["ingressClassName"] == "nginx"
    (rule,) = ingress["rules"]
    assert "host" not in rule
    assert rule["http"]["paths"] == [
        {
            "path": "/v1",
            "pathType": "Prefix",
            "backend": {"service": {"name": "rel-kvgate", "port": {"name": "http"}}},
        }
    ]
    route = docs["HTTPRoute/rel-kvgate"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "gw", "sectionName": "https"}]
    (route_rule,) = route["spec"]["rules"]
    assert route_rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    validate_strictly(docs)
    with pytest.raises(helm_python.HelmError, match=r"httpRoute\.parentRefs"):
        render({"httpRoute": {"enabled": True}})


def test_network_policy() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"team": "apps"}}}
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render({"networkPolicy": {"enabled": True, "ingressFrom": [peer], "metricsFrom": [monitoring]}})
    spec = docs["NetworkPolicy/rel-kvgate"]["spec"]
    assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "rel"
    assert spec["policyTypes"] == ["Ingress"]  # egress stays open unless rules are given
    assert spec["ingress"] == [
        {"ports": [{"port": "http", "protocol": "TCP"}], "from": [peer]},
        {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": [monitoring]},
    ]
    validate_strictly(docs)
    egress_rule = {"to": [{"podSelector": {"matchLabels": {"app": "vllm"}}}], "ports": [{"port": 8000}]}
    restricted = render({"networkPolicy": {"enabled": True, "egress": [egress_rule]}})
    spec = restricted["NetworkPolicy/rel-kvgate"]["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert {p["port"] for p in spec["egress"][0]["ports"]} == {53}
    # Then the chart's sync broker (test_chart_sync.py), then the given rules.
    assert spec["egress"][2:] == [egress_rule]
    validate_strictly(restricted)


def test_tracing_sets_the_config_flag_and_the_otel_environment() -> None:
    assert "tracing" not in gateway_config(render())
    assert not any(name.startswith("OTEL_") for name in env(render()))
    docs = render(
        {
            "tracing": {
                "enabled": True,
                "otlp": {"endpoint": "http://otel:4318", "headersSecret": {"name": "otel-auth"}},
                "resourceAttributes": {"deployment.environment": "prod"},
            }
        }
    )
    assert gateway_config(docs)["tracing"] == {"enabled": True}
    variables = env(docs)
    assert variables["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4318"
    assert variables["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "http/protobuf"
    assert variables["OTEL_SERVICE_NAME"]["value"] == "kvgate"
    assert variables["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"] == {
        "name": "otel-auth",
        "key": "headers",
    }
    attributes = variables["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(",")
    assert "deployment.environment=prod" in attributes
    assert "k8s.pod.name=$(KVGATE_POD_NAME)" in attributes
    # $(VAR) expands only from variables defined earlier in the list.
    names = [e["name"] for e in container(docs)["env"]]
    assert names.index("KVGATE_POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    validate_strictly(docs)


def test_extra_volumes_env_and_env_from() -> None:
    docs = render(
        {
            "extraVolumes": [{"name": "tokenizer", "configMap": {"name": "tok"}}],
            "extraVolumeMounts": [{"name": "tokenizer", "mountPath": "/models/m", "readOnly": True}],
            "extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
            "envFrom": [{"secretRef": {"name": "more"}}],
        }
    )
    c = container(docs)
    assert {"name": "tokenizer", "mountPath": "/models/m", "readOnly": True} in c["volumeMounts"]
    assert {"name": "tokenizer", "configMap": {"name": "tok"}} in pod_spec(docs)["volumes"]
    assert env(docs)["HF_HUB_OFFLINE"]["value"] == "1"
    assert c["envFrom"] == [{"secretRef": {"name": "more"}}]
    validate_strictly(docs)


def test_grafana_dashboard_configmap() -> None:
    assert "ConfigMap/rel-kvgate-dashboard" not in render()
    docs = render({"grafanaDashboard": {"enabled": True}})
    cm = docs["ConfigMap/rel-kvgate-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "kvgate.json").read_text())
    assert json.loads(cm["data"]["kvgate.json"]) == shipped
    other = render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}})
    assert other["ConfigMap/llm.rel-kvgate-dashboard@monitoring"]["metadata"]["namespace"] == "monitoring"
    validate_strictly(docs)


def test_everything_on_validates_strictly() -> None:
    docs = render(
        {
            "tenants": [TENANT],
            "kubernetesDiscovery": {"enabled": True},
            "pools": [KUBE_POOL],
            "autoscaling": {"enabled": True},
            "ingress": {"enabled": True},
            "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]},
            "networkPolicy": {"enabled": True, "egress": [{"ports": [{"port": 443}]}]},
            "tracing": {"enabled": True},
            "grafanaDashboard": {"enabled": True},
            "serviceMonitor": {"enabled": True},
            "podDisruptionBudget": {"enabled": True},
            "keyHashSecret": {"value": VALUE},
        }
    )
    assert len(docs) >= 14
    validate_strictly(docs)
