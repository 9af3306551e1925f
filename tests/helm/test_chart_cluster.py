"""What the chart does for the cluster around it: probes that a full client port cannot fail, a
preStop hook each Kubernetes version accepts, names that releases in other namespaces do not
share, the broker's own NetworkPolicy, spread and disruption budget, the least RBAC, and the
key-hash secret required up front."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.helm.chart import (
    CHART,
    CRD_KINDS,
    IMAGE,
    POOL,
    RELEASE,
    REQUIRED,
    TENANT,
    Docs,
    container,
    pod_spec,
    render,
    render_raw,
    validate_strictly,
)

SELECTOR = {"app.kubernetes.io/name": "kvgate", "app.kubernetes.io/instance": RELEASE}
NATS = f"{RELEASE}-kvgate-nats"


def kube_pool(namespace: str | None = None) -> dict[str, Any]:
    kubernetes: dict[str, Any] = {"selector": {"app": "vllm"}, "port": 8000}
    if namespace is not None:
        kubernetes["namespace"] = namespace
    return POOL | {"workers": {"kubernetes": kubernetes}}


def validate_for(docs: Docs, version: str) -> None:
    for doc in docs.values():
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)


# ---------------------------------------------------------------- probes


@pytest.mark.parametrize("processes", [1, 3])
def test_the_probes_go_to_the_metrics_port_never_the_client_port(processes: int) -> None:
    # The client port closes new connections at max_client_connections, the kubelet's among them;
    # the metrics listener has no cap. With several processes: process 0's port.
    docs = render({"processes": processes})
    c = container(docs)
    probes = {name: c[name]["httpGet"] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {
        "startupProbe": {"path": "/healthz", "port": "metrics"},
        "livenessProbe": {"path": "/healthz", "port": "metrics"},
        "readinessProbe": {"path": "/readyz", "port": "metrics"},
    }
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in c["ports"]
    validate_strictly(docs)


# ---------------------------------------------------------------- preStop across versions


@pytest.mark.parametrize(
    ("version", "pre_stop"),
    [
        ("1.28.0", {"exec": {"command": ["sleep", "7"]}}),
        ("1.29.4", {"exec": {"command": ["sleep", "7"]}}),  # there `sleep` is behind a feature gate
        ("1.30.0", {"sleep": {"seconds": 7}}),
        ("1.33.1", {"sleep": {"seconds": 7}}),
    ],
)
def test_pre_stop_sleeps_with_what_the_cluster_accepts(version: str, pre_stop: dict[str, Any]) -> None:
    docs = render({"shutdown": {"preStopSleepSeconds": 7}}, kube_version=version)
    assert container(docs)["lifecycle"]["preStop"] == pre_stop
    validate_for(docs, version)
    assert "lifecycle" not in container(
        render({"shutdown": {"preStopSleepSeconds": 0}}, kube_version=version)
    )


def test_everything_on_validates_on_1_28() -> None:
    docs = render(
        {
            "kubernetesDiscovery": {"enabled": True},
            "pools": [kube_pool("inference")],
            "networkPolicy": {"enabled": True},
            "grafanaDashboard": {"enabled": True, "namespace": "monitoring"},
            "autoscaling": {"enabled": True},
        },
        kube_version="1.28.0",
    )
    validate_for(docs, "1.28.0")


# ---------------------------------------------------------------- names in other namespaces


def test_releases_of_one_name_in_two_namespaces_share_no_resource() -> None:
    values = {
        "kubernetesDiscovery": {"enabled": True},
        "pools": [kube_pool("inference")],
        "grafanaDashboard": {"enabled": True, "namespace": "monitoring"},
    }
    a, b = render(values, namespace="team-a"), render(values, namespace="team-b")
    elsewhere = [k for k in a if "@" in k]
    assert sorted(elsewhere) == [
        "ConfigMap/team-a.rel-kvgate-dashboard@monitoring",
        "Role/team-a.rel-kvgate-discovery@inference",
        "RoleBinding/team-a.rel-kvgate-discovery@inference",
    ]
    assert not set(elsewhere) & {k for k in b if "@" in k}
    binding = a["RoleBinding/team-a.rel-kvgate-discovery@inference"]
    assert binding["roleRef"]["name"] == "team-a.rel-kvgate-discovery"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kvgate", "namespace": "team-a"}]
    validate_strictly(a)
    # In the release's own namespace the names stay as they were.
    here = render({**values, "pools": [kube_pool()], "grafanaDashboard": {"enabled": True}})
    assert {"Role/rel-kvgate-discovery", "ConfigMap/rel-kvgate-dashboard"} <= here.keys()


# ---------------------------------------------------------------- RBAC


def test_discovery_rbac_lists_and_watches_only_where_a_pool_watches() -> None:
    docs = render(
        {
            "kubernetesDiscovery": {"enabled": True},
            "pools": [kube_pool("inference"), POOL | {"name": "b", "models": ["other-model"]}],
        }
    )
    roles = [k for k in docs if k.startswith("Role")]
    assert roles == [
        "Role/llm.rel-kvgate-discovery@inference",
        "RoleBinding/llm.rel-kvgate-discovery@inference",
    ]
    rules = docs["Role/llm.rel-kvgate-discovery@inference"]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    # Discovery on with nowhere to grant: the gateway would get 403 and its pools stay empty.
    with pytest.raises(helm_python.HelmError, match=r"kubernetesDiscovery\.namespaces"):
        render({"kubernetesDiscovery": {"enabled": True}})
    no_rbac = render({"kubernetesDiscovery": {"enabled": True, "rbac": {"create": False}}})
    assert not any(k.startswith("Role") for k in no_rbac)


def test_discovery_rbac_with_a_config_of_ones_own_covers_the_listed_namespaces() -> None:
    """With configSecret.existingSecret the chart cannot see the pools: the namespaces they watch
    are listed in kubernetesDiscovery.namespaces (merged with any pool's)."""
    own = {"configSecret": {"existingSecret": "own-config"}, "tenants": []}
    with pytest.raises(helm_python.HelmError, match=r"kubernetesDiscovery\.namespaces"):
        render({**own, "kubernetesDiscovery": {"enabled": True}})
    docs = render({**own, "kubernetesDiscovery": {"enabled": True, "namespaces": ["inference", "llm"]}})
    assert sorted(k for k in docs if k.startswith("Role")) == [
        "Role/llm.rel-kvgate-discovery@inference",
        "Role/rel-kvgate-discovery",
        "RoleBinding/llm.rel-kvgate-discovery@inference",
        "RoleBinding/rel-kvgate-discovery",
    ]
    validate_strictly(docs)
    merged = render(
        {
            "kubernetesDiscovery": {"enabled": True, "namespaces": ["inference", "batch"]},
            "pools": [kube_pool("inference")],
        }
    )
    assert sorted(k for k in merged if k.startswith("Role/")) == [
        "Role/llm.rel-kvgate-discovery@batch",
        "Role/llm.rel-kvgate-discovery@inference",
    ]
    with pytest.raises(helm_python.HelmValuesError, match="/kubernetesDiscovery/namespaces"):
        render({"kubernetesDiscovery": {"enabled": True, "namespaces": ["Not_A_Namespace"]}})


@pytest.mark.parametrize(
    "service_account", [{"create": False}, {"create": False, "name": "default"}, {"name": "default"}]
)
def test_discovery_rbac_never_binds_the_default_service_account(service_account: dict[str, Any]) -> None:
    values = {
        "kubernetesDiscovery": {"enabled": True},
        "pools": [kube_pool()],
        "serviceAccount": service_account,
    }
    with pytest.raises(helm_python.HelmError, match="`default` service account"):
        render(values)
    # Without the chart's RBAC the account is the operator's business.
    render({**values, "kubernetesDiscovery": {"enabled": True, "rbac": {"create": False}}})


# ---------------------------------------------------------------- the key-hash secret


def test_an_install_without_a_key_hash_secret_fails_at_once() -> None:
    values = {"tenants": [TENANT], "pools": [POOL], "image": IMAGE}
    with pytest.raises(helm_python.HelmError, match=r"keyHashSecret: set existingSecret .* or value"):
        render_raw(values)
    with pytest.raises(helm_python.HelmError, match="keyHashSecret/value"):
        render_raw(values | {"keyHashSecret": {"value": "x" * 31}})
    assert "Secret/rel-kvgate-key-hash" in render_raw(values | {"keyHashSecret": {"value": "x" * 32}})
    assert "Secret/rel-kvgate-key-hash" not in render_raw(values | {"keyHashSecret": {"existingSecret": "k"}})


# ---------------------------------------------------------------- the broker's NetworkPolicy


def test_the_charts_broker_is_fenced_off_by_default() -> None:
    docs = render()  # networkPolicy.enabled is false
    policy = docs[f"NetworkPolicy/{NATS}"]["spec"]
    nats_labels = docs[f"Deployment/{NATS}"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= nats_labels.items()
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": SELECTOR}}], "ports": [{"port": "nats", "protocol": "TCP"}]}
    ]
    assert policy["egress"] == []
    assert f"NetworkPolicy/{RELEASE}-kvgate" not in docs  # the gateway's own stays opt-in
    validate_strictly(docs)
    off = render({"sync": {"nats": {"networkPolicy": {"enabled": False}}}})
    assert f"NetworkPolicy/{NATS}" not in off
    external = render({"sync": {"url": "nats://nats.shared:4222"}})
    assert not any(k.startswith("NetworkPolicy/") for k in external)


# ---------------------------------------------------------------- spread and disruption


def test_pods_spread_over_nodes_by_default() -> None:
    (spread,) = pod_spec(render())["topologySpreadConstraints"]
    assert spread == {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": SELECTOR},
        "matchLabelKeys": ["pod-template-hash"],
    }
    zones = [
        {
            "maxSkew": 2,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": SELECTOR},
        }
    ]
    docs = render({"topologySpreadConstraints": zones})
    assert pod_spec(docs)["topologySpreadConstraints"] == zones
    validate_strictly(docs)
    assert "topologySpreadConstraints" not in pod_spec(render({"topologySpread": {"enabled": False}}))
    zone_default = render({"topologySpread": {"topologyKey": "topology.kubernetes.io/zone"}})
    assert (
        pod_spec(zone_default)["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    )


def test_pods_may_spread_over_zones_too() -> None:
    node = {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": SELECTOR},
        "matchLabelKeys": ["pod-template-hash"],
    }
    zone = node | {"topologyKey": "topology.kubernetes.io/zone"}
    docs = render({"topologySpread": {"zone": {"enabled": True}}})
    assert pod_spec(docs)["topologySpreadConstraints"] == [node, zone]
    validate_strictly(docs)
    strict = render(
        {
            "topologySpread": {
                "enabled": False,
                "zone": {"enabled": True, "maxSkew": 2, "whenUnsatisfiable": "DoNotSchedule"},
            }
        }
    )
    assert pod_spec(strict)["topologySpreadConstraints"] == [
        zone | {"maxSkew": 2, "whenUnsatisfiable": "DoNotSchedule"}
    ]
    assert len(pod_spec(render())["topologySpreadConstraints"]) == 1  # off by default


def test_a_disruption_budget_by_default() -> None:
    docs = render()
    pdb = docs[f"PodDisruptionBudget/{RELEASE}-kvgate"]["spec"]
    assert pdb == {
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
        "selector": {"matchLabels": SELECTOR},
    }
    validate_strictly(docs)
    assert f"PodDisruptionBudget/{RELEASE}-kvgate" not in render({"podDisruptionBudget": {"enabled": False}})


def test_the_tmp_emptydir_does_not_block_cluster_autoscaler_scale_down() -> None:
    """cluster-autoscaler leaves a node holding a pod with local storage (an emptyDir) unless the
    pod names those volumes safe to evict; the disruption budget still applies to the eviction."""
    docs = render()
    annotations = docs[f"Deployment/{RELEASE}-kvgate"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"] == "tmp"
    assert "emptyDir" in {v["name"]: v for v in pod_spec(docs)["volumes"]}["tmp"]
    assert f"PodDisruptionBudget/{RELEASE}-kvgate" in docs
    validate_strictly(docs)
    # podAnnotations may say otherwise (e.g. to add an emptyDir of extraVolumes): theirs wins.
    key = "cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"
    docs = render({"podAnnotations": {key: "tmp,scratch"}})
    annotations = docs[f"Deployment/{RELEASE}-kvgate"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations[key] == "tmp,scratch"


# ---------------------------------------------------------------- resources and labels


def test_one_core_per_process_is_requested_by_default() -> None:
    assert container(render())["resources"]["requests"]["cpu"] == "1"


def test_pod_labels_name_the_component_but_no_chart_version() -> None:
    docs = render()
    deployment = docs[f"Deployment/{RELEASE}-kvgate"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    # A chart bump alone changes no pod template, so it restarts no pod.
    assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels
    assert labels["app.kubernetes.io/component"] == "gateway"
    assert deployment["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    # The selector is immutable on a Deployment: it must stay what it was.
    assert deployment["spec"]["selector"]["matchLabels"] == SELECTOR
    assert SELECTOR.items() <= labels.items()
    broker = docs[f"Deployment/{NATS}"]["spec"]["template"]["metadata"]["labels"]
    assert "helm.sh/chart" not in broker and broker["app.kubernetes.io/component"] == "sync-broker"


# ---------------------------------------------------------------- Kubernetes versions


def test_the_chart_declares_the_oldest_kubernetes_its_fields_work_on() -> None:
    """matchLabelKeys of a topology spread constraint and a disruption budget's
    unhealthyPodEvictionPolicy are on by default from 1.27 (beta); before it the API server drops
    them (the spread then counts the old rollout's pods, a stuck pod blocks node drains)."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.27.0-0"
    docs = render(kube_version="1.27.0")
    assert pod_spec(docs)["topologySpreadConstraints"][0]["matchLabelKeys"] == ["pod-template-hash"]
    assert (
        docs[f"PodDisruptionBudget/{RELEASE}-kvgate"]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    )
    with pytest.raises(helm_python.HelmError, match="kubeVersion"):
        render(kube_version="1.26.9")


def test_a_chart_version_bump_alone_changes_no_pod_template(tmp_path: Path) -> None:
    """The checksums that roll the pods hash the data (config, secrets, policy), never a whole
    manifest: those carry the chart's version label, and `helm upgrade` to a new chart version
    with the same values would restart every gateway and the broker."""
    bumped = tmp_path / "kvgate"
    shutil.copytree(CHART, bumped)
    meta = yaml.safe_load((bumped / "Chart.yaml").read_text())
    meta["version"] = meta["version"] + "-bumped"
    (bumped / "Chart.yaml").write_text(yaml.safe_dump(meta))
    values = REQUIRED | {
        "keyHashSecret": {"value": "k" * 40},
        "sync": {"auth": {"token": "a1" * 20}},
        "policy": {"rollOnChange": True},
    }
    before, after = render_raw(values), render_raw(values, chart_dir=bumped)
    chart_label = "helm.sh/chart"
    assert (
        before[f"Secret/{RELEASE}-kvgate-config"]["metadata"]["labels"][chart_label]
        != (after[f"Secret/{RELEASE}-kvgate-config"]["metadata"]["labels"][chart_label])
    )
    for name in (f"{RELEASE}-kvgate", NATS):
        template = before[f"Deployment/{name}"]["spec"]["template"]
        assert any(key.startswith("checksum/") for key in template["metadata"]["annotations"]), name
        assert after[f"Deployment/{name}"]["spec"]["template"] == template, name
    # The checksums still follow the data they stand for.
    rotated = render_raw(
        values | {"keyHashSecret": {"value": "m" * 40}, "sync": {"auth": {"token": "b2" * 20}}}
    )
    for name, keys in (
        (f"{RELEASE}-kvgate", ("checksum/key-hash", "checksum/sync-token")),
        (NATS, ("checksum/sync-token",)),
    ):
        old = before[f"Deployment/{name}"]["spec"]["template"]["metadata"]["annotations"]
        new = rotated[f"Deployment/{name}"]["spec"]["template"]["metadata"]["annotations"]
        assert all(old[key] != new[key] for key in keys), name


def test_every_service_name_fits_a_dns_label_with_the_longest_release_name() -> None:
    """Helm allows release names of 53 characters: the metrics Service (and the job label the
    alerts select, its name) is cut like the broker's, never past the 63 a Service name allows."""
    release = "a" * 44 + "-llm-prod"
    assert len(release) == 53
    values = REQUIRED | {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    out = helm_python.Chart.load(str(CHART)).render(values, name=release, namespace="llm", is_install=True)
    docs = [
        doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc
    ]
    # A Service's name is a DNS-1035 label (other objects take a longer DNS subdomain).
    services = [doc["metadata"]["name"] for doc in docs if doc["kind"] == "Service"]
    assert len(services) == 3 and all(len(name) <= 63 for name in services), services
    (metrics,) = [
        doc["metadata"]["name"]
        for doc in docs
        if doc["kind"] == "Service"
        and doc["metadata"]["labels"].get("app.kubernetes.io/component") == "metrics"
    ]
    assert metrics.endswith("-metrics") and not metrics.endswith("--metrics")
    (rules,) = [doc for doc in docs if doc["kind"] == "PrometheusRule"]
    assert all(f'job="{metrics}"' in rule["expr"] for rule in rules["spec"]["groups"][0]["rules"])
