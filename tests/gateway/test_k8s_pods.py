"""Kubernetes discovery without a server: the pool's `kubernetes` block, label selectors, and which
pods are routable and where."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.k8s.pods import PodSettings, read_pod
from gateway.k8s.selector import normalize_selector
from tests.gateway.fake_kube_api import make_pod

HASH = "hmac-sha256:" + "0" * 64


def _pool(**pool: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], **pool}],
        "tenants": [{"name": "t", "api_key_hashes": [HASH]}],
    }


def test_a_kubernetes_pool_parses_with_defaults_and_a_map_selector() -> None:
    block = {
        "selector": {"app": "vllm", "kvgate.io/pool": "llama"},
        "port": "http",
        "role_label": "kvgate.io/role",
    }
    pool = parse_config(_pool(kubernetes=block)).pools[0]
    k8s = pool.kubernetes
    assert k8s is not None and k8s.selector == "app=vllm,kvgate.io/pool=llama"
    assert k8s.port == "http" and k8s.namespace is None and k8s.api_server is None and k8s.scheme == "http"
    assert not pool.subscribes_kv_events
    numbered = parse_config(
        _pool(kubernetes={"selector": "app=vllm", "port": "8000", "kv_events_port": 5557})
    )
    assert numbered.pools[0].kubernetes is not None and numbered.pools[0].kubernetes.port == 8000
    assert numbered.pools[0].subscribes_kv_events


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"selector": "", "port": 8000}, "selector: Value error, the selector is empty"),
        ({"selector": "app in ()", "port": 8000}, "needs at least one value"),
        ({"selector": "app==two words", "port": 8000}, "is not a label requirement"),
        ({"selector": {"app": True}, "port": 8000}, "quote values"),
        ({"selector": "app=vllm", "port": 0}, "port: Value error, port 0 is out of range"),
        ({"selector": "app=vllm", "port": "Not_A_Name"}, "neither a port number nor a container port name"),
        ({"selector": "app=vllm", "port": True}, "must be a port number"),
        ({"selector": "app=vllm", "port": 8000, "namespace": "Bad_NS"}, "kubernetes.namespace"),
        (
            {"selector": "app=vllm", "port": 8000, "role_label": "bad key"},
            "not a valid label or annotation key",
        ),
        ({"selector": "app=vllm", "port": 8000, "api_server": "10.0.0.1:6443"}, "must start with http"),
        ({"selector": "app=vllm", "port": 8000, "colour": "blue"}, "kubernetes.colour: Extra inputs"),
        ({"port": 8000}, "kubernetes.selector: Field required"),
        (
            {"selector": "app=vllm", "port": 8000, "kv_events_port": 1, "kv_events_annotation": "a/b"},
            "at most one of kv_events_port and kv_events_annotation",
        ),
    ],
)
def test_bad_kubernetes_blocks_name_the_field(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_pool(kubernetes=block))


def test_a_pool_has_exactly_one_source_and_one_kv_event_source() -> None:
    k8s = {"selector": "app=vllm", "port": 8000}
    with pytest.raises(ConfigError, match=r"exactly one of 'workers'.*'kubernetes'"):
        parse_config(_pool(kubernetes=k8s, dns={"name": "h", "port": 80}))
    with pytest.raises(ConfigError, match=r"kv_events_endpoint and kubernetes\.kv_events_port"):
        parse_config(
            _pool(kubernetes={**k8s, "kv_events_port": 5557}, kv_events_endpoint="tcp://{host}:5557")
        )
    templated = parse_config(_pool(kubernetes=k8s, kv_events_endpoint="tcp://{host}:5557")).pools[0]
    assert templated.subscribes_kv_events


def test_selectors_follow_the_kubectl_grammar() -> None:
    assert normalize_selector("app = vllm, tier in (gpu, a100)") == "app = vllm,tier in (gpu, a100)"
    assert normalize_selector("!canary,app.kubernetes.io/name==vllm,gen>3,x notin (a)")
    assert normalize_selector({"app": "vllm"}) == "app=vllm"
    for bad in ("app=vllm,", "x in (a", "-x=1", "gen>a", "a/b/c=1"):
        with pytest.raises(ValueError):
            normalize_selector(bad)


SETTINGS = PodSettings(port="http", role_label="kvgate.io/role", kv_events_annotation="kvgate.io/kv-events")


def test_only_running_ready_pods_with_an_ip_and_the_port_are_routable() -> None:
    ok = read_pod(make_pod("a", "10.0.0.7", port=8001), SETTINGS)
    assert ok.endpoint is not None and ok.endpoint.url == "http://10.0.0.7:8001" and ok.problem is None
    assert read_pod(make_pod("a", ready=False), SETTINGS).endpoint is None
    assert read_pod(make_pod("a", phase="Pending"), SETTINGS).endpoint is None
    assert read_pod(make_pod("a", ip=""), SETTINGS).endpoint is None
    terminating = make_pod("a")
    terminating["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert read_pod(terminating, SETTINGS).endpoint is None  # draining: no new requests
    unnamed = read_pod(make_pod("a", port_name="metrics"), SETTINGS)
    assert unnamed.endpoint is None and unnamed.problem == "no container port named 'http'"
    v6 = read_pod(make_pod("a", "fd00::7", port=8000), PodSettings(port=9000, scheme="https"))
    assert v6.endpoint is not None and v6.endpoint.url == "https://[fd00::7]:9000"
    garbage: dict[str, Any] = {"metadata": "x", "status": {"conditions": [None, 3]}, "spec": []}
    assert read_pod(garbage, SETTINGS).endpoint is None


def test_role_label_and_kv_event_endpoints_by_annotation_or_port() -> None:
    labels = {"app": "vllm", "kvgate.io/role": "prefill"}
    for value, expected in [
        ("5557", "tcp://10.0.0.7:5557"),
        ("tcp://{host}:6000", "tcp://10.0.0.7:6000"),
        ("tcp://10.9.9.9:7000", "tcp://10.9.9.9:7000"),
    ]:
        pod = make_pod("a", "10.0.0.7", labels=labels, annotations={"kvgate.io/kv-events": value})
        verdict = read_pod(pod, SETTINGS)
        assert verdict.endpoint is not None and verdict.problem is None
        assert verdict.endpoint.details.role == "prefill"
        assert verdict.endpoint.details.kv_events_endpoint == expected
    silent = read_pod(make_pod("a"), SETTINGS)
    assert silent.endpoint is not None and silent.endpoint.details.kv_events_endpoint is None
    assert silent.endpoint.details.role is None
    bad = read_pod(make_pod("a", annotations={"kvgate.io/kv-events": "nonsense"}), SETTINGS)
    assert bad.endpoint is not None and bad.problem is not None and "annotation" in bad.problem
    by_name = PodSettings(port=8000, kv_events_port="kv-events")
    named = read_pod(make_pod("a", "10.0.0.7", extra_ports={"kv-events": 5557}), by_name)
    assert named.endpoint is not None and named.endpoint.details.kv_events_endpoint == "tcp://10.0.0.7:5557"
    missing = read_pod(make_pod("a"), by_name)
    assert missing.endpoint is not None and missing.problem is not None


@pytest.mark.parametrize(
    "value",
    [
        "tcp://{host.ip}:5557",  # a plausible typo: attribute access in a format field
        "tcp://{host:>99999999}:5557",  # a format spec that would pad to 100 MB
        "tcp://{0}:5557",
        "tcp://{host}:{port}",
        "\u00b2",  # a digit to str.isdigit, not to int()
    ],
)
def test_an_annotation_is_text_not_a_format_string(value: str) -> None:
    """Whoever labels a worker pod writes its annotations: a bad one is that pod's problem only."""
    verdict = read_pod(make_pod("a", "10.0.0.7", annotations={"kvgate.io/kv-events": value}), SETTINGS)
    assert verdict.endpoint is not None and verdict.endpoint.url == "http://10.0.0.7:8000"
    assert verdict.endpoint.details.kv_events_endpoint is None
    assert verdict.problem is not None and "annotation" in verdict.problem


def test_malformed_ports_and_addresses_make_a_pod_unroutable() -> None:
    junk_port = make_pod("a", "10.0.0.7")
    junk_port["spec"]["containers"][0]["ports"][:0] = ["http", 8000, None]
    kept = read_pod(junk_port, SETTINGS)  # the well-formed entry after the junk still counts
    assert kept.endpoint is not None and kept.endpoint.url == "http://10.0.0.7:8000"
    for ip in ("evil.example/x?", "10.0.0.7:9", "10.0.0.300", " 10.0.0.7"):
        verdict = read_pod(make_pod("a", ip), SETTINGS)
        assert verdict.endpoint is None and verdict.problem is not None and "podIP" in verdict.problem
    canonical = read_pod(make_pod("a", "fd00:0:0::7"), SETTINGS)
    assert canonical.endpoint is not None and canonical.endpoint.url == "http://[fd00::7]:8000"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    path=st.sampled_from(
        [
            ("metadata",),
            ("metadata", "annotations"),
            ("metadata", "annotations", "kvgate.io/kv-events"),
            ("metadata", "labels", "kvgate.io/role"),
            ("spec",),
            ("spec", "containers"),
            ("spec", "containers", 0),
            ("spec", "containers", 0, "ports"),
            ("spec", "containers", 0, "ports", 0),
            ("spec", "containers", 0, "ports", 0, "containerPort"),
            ("status",),
            ("status", "podIP"),
            ("status", "conditions"),
            ("status", "conditions", 1),
        ]
    ),
    junk=_JSON,
    by_port_name=st.booleans(),
)
def test_no_pod_object_makes_read_pod_raise(
    path: tuple[str | int, ...], junk: object, by_port_name: bool
) -> None:
    """One malformed pod must never break the list or watch that carries it (every other pod too)."""
    pod: Any = make_pod("a", "10.0.0.7", extra_ports={"kv": 5557})
    *parents, last = path
    target = pod
    for step in parents:
        target = target[step]
    target[last] = junk
    kv = PodSettings(port="http", kv_events_port="kv") if by_port_name else SETTINGS
    read_pod(pod, kv)


def test_the_documented_kubernetes_pool_is_valid() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "kubernetes:" in b)
    pool = parse_config(
        {**yaml.safe_load(block), "tenants": [{"name": "t", "api_key_hashes": [HASH]}]}
    ).pools[0]
    assert pool.kubernetes is not None and pool.kubernetes.port == "http" and pool.subscribes_kv_events
    assert pool.kubernetes.selector == "app.kubernetes.io/name=vllm,model=llama-8b"
