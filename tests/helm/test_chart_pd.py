"""Prefill/decode pools in the chart: workers with roles (static lists, or pods by a role label) and
the pool's `pd` block, rendered into a gateway config the gateway accepts with those roles."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from gateway.config import parse_config
from tests.helm.chart import POOL, gateway_config, render, validate_strictly

PREFILL, DECODE, MIXED = "http://10.0.1.1:8000", "http://10.0.2.1:8000", "http://10.0.3.1:8000"
ROLES: dict[str, Any] = {"urls": [MIXED], "prefillUrls": [PREFILL], "decodeUrls": [DECODE]}
KUBE: dict[str, Any] = {"selector": {"app": "vllm"}, "port": 8000, "roleLabel": "kvgate.io/role"}


def test_static_roles_and_every_pd_key() -> None:
    pd = {
        "protocol": "sglang",
        "transfer": {"setupSeconds": 0, "bytesPerToken": 65536, "bandwidthBytesPerSecond": 2.5e10},
        "conditional": False,
        "interferenceWeight": 0.5,
        "bootstrapPort": 8998,
        "bootstrapPorts": {PREFILL: 9000},
    }
    docs = render({"pools": [POOL | {"workers": ROLES, "pd": pd}]})
    (rendered,) = gateway_config(docs)["pools"]
    assert (rendered["workers"], rendered["prefill_workers"], rendered["decode_workers"]) == (
        [MIXED],
        [PREFILL],
        [DECODE],
    )
    assert rendered["pd"] == {
        "protocol": "sglang",
        "transfer": {"setup_s": 0, "bytes_per_token": 65536, "bandwidth_bytes_per_s": 25_000_000_000},
        "conditional": False,
        "interference_weight": 0.5,
        "bootstrap_port": 8998,
        "bootstrap_ports": {PREFILL: 9000},
    }
    (pool,) = parse_config(gateway_config(docs)).pools
    assert pool.static_roles == {PREFILL: "prefill", DECODE: "decode"} and pool.workers == [MIXED]
    assert pool.pd is not None and pool.pd.bootstrap_port_of(PREFILL) == 9000
    validate_strictly(docs)


def test_an_empty_pd_block_means_the_gateways_defaults() -> None:
    docs = render(
        {"pools": [POOL | {"workers": {"prefillUrls": [PREFILL], "decodeUrls": [DECODE]}, "pd": {}}]}
    )
    assert gateway_config(docs)["pools"][0]["pd"] == {"protocol": "vllm"}
    (pool,) = parse_config(gateway_config(docs)).pools
    assert pool.pd is not None and pool.pd.conditional is True and pool.pd.transfer.bytes_per_token == 131072


def test_roles_from_a_pod_label() -> None:
    docs = render(
        {
            "kubernetesDiscovery": {"enabled": True},
            "pools": [POOL | {"workers": {"kubernetes": KUBE}, "pd": {}}],
        }
    )
    (pool,) = parse_config(gateway_config(docs)).pools
    assert pool.kubernetes is not None and pool.kubernetes.role_label == "kvgate.io/role"
    assert pool.pd is not None
    # Without a pd block the role label is still passed on (the pool just treats every pod as mixed).
    plain = render(
        {"kubernetesDiscovery": {"enabled": True}, "pools": [POOL | {"workers": {"kubernetes": KUBE}}]}
    )
    assert gateway_config(plain)["pools"][0]["kubernetes"]["role_label"] == "kvgate.io/role"
    assert "pd" not in gateway_config(plain)["pools"][0]


@pytest.mark.parametrize(
    "workers",
    [
        {"urls": [MIXED, PREFILL]},
        {"dns": {"name": "vllm.llm.svc", "port": 8000}},
        {"kubernetes": {k: v for k, v in KUBE.items() if k != "roleLabel"}},
    ],
)
def test_a_holder_prefill_pool_needs_no_roles(workers: dict[str, Any]) -> None:
    pd = {"mode": "holder_prefill", "holderShare": 0.6}
    # Discovery only for the pods' pool: on with nothing to watch, the chart has no RBAC to create.
    discovery = {"enabled": "kubernetes" in workers}
    docs = render({"kubernetesDiscovery": discovery, "pools": [POOL | {"workers": workers, "pd": pd}]})
    (rendered,) = gateway_config(docs)["pools"]
    assert rendered["pd"] == {"protocol": "vllm", "mode": "holder_prefill", "holder_share": 0.6}
    (pool,) = parse_config(gateway_config(docs)).pools
    assert pool.pd is not None and pool.pd.mode == "holder_prefill" and pool.static_roles == {}
    validate_strictly(docs)


def test_pools_without_pd_render_as_before() -> None:
    (pool,) = gateway_config(render())["pools"]
    assert set(pool) == {"name", "models", "workers"}


@pytest.mark.parametrize(
    ("pool", "needle"),
    [
        ({"workers": {"prefillUrls": [PREFILL], "decodeUrls": [DECODE]}}, "need the pool's pd block"),
        (
            {"workers": {"dns": {"name": "vllm.llm.svc", "port": 8000}}, "pd": {}},
            "DNS discovery knows no roles",
        ),
        (
            {"workers": {"kubernetes": {k: v for k, v in KUBE.items() if k != "roleLabel"}}, "pd": {}},
            "roleLabel is required",
        ),
        (
            {"workers": {"prefillUrls": [PREFILL], "dns": {"name": "v", "port": 1}}, "pd": {}},
            "exactly one of",
        ),
        ({"workers": ROLES, "pd": {"protocol": "nixl"}}, "/pd/protocol"),
        ({"workers": ROLES, "pd": {"mode": "always"}}, "/pd/mode"),
        ({"workers": ROLES, "pd": {"mode": "holder_prefill"}}, "takes mixed workers only"),
        ({"workers": {"kubernetes": KUBE}, "pd": {"mode": "holder_prefill"}}, "takes mixed workers only"),
        ({"workers": ROLES, "pd": {"holderShare": 1}}, "/pd/holderShare"),
        ({"workers": ROLES, "pd": {"transfer": {"bandwidth": 1}}}, "additional properties 'bandwidth'"),
        ({"workers": ROLES, "pd": {"bootstrapPorts": {"10.0.1.1": 9000}}}, "invalid propertyName '10.0.1.1'"),
        ({"workers": {"prefillUrls": ["10.0.1.1:8000"]}, "pd": {}}, "/workers/prefillUrls/0"),
    ],
)
def test_bad_pd_values_fail_clearly(pool: dict[str, Any], needle: str) -> None:
    discovery = {"enabled": "kubernetes" in pool["workers"]}
    with pytest.raises(helm_python.HelmError, match=needle):
        render({"kubernetesDiscovery": discovery, "pools": [POOL | pool]})
