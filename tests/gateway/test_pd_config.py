"""The `pd` section of a pool and per-worker roles: parsed strictly, and kept by the registry
whether workers come from the config or from discovery."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.config.pool import PoolConfig
from gateway.registry import Pool
from policies.base import Role
from policies.pd import SGLANG_ROLES, VLLM_ROLES
from tests.gateway.test_docs_config import DOC

P, D, M = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


def config(**pool: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], **pool}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"s", "k")]}],
    }


def test_a_pd_pool_with_static_roles() -> None:
    cfg = parse_config(
        config(
            prefill_workers=[P + "/"],
            decode_workers=[D],
            workers=[M],
            pd={"protocol": "sglang", "bootstrap_port": 8998, "transfer": {"setup_s": 0.002}},
        )
    )
    pool_cfg = cfg.pools[0]
    assert pool_cfg.static_urls == [M, P, D]
    assert pool_cfg.pd is not None and pool_cfg.pd.transfer.setup_s == 0.002
    assert pool_cfg.pd.transfer.bytes_per_token == 131_072 and pool_cfg.pd.conditional
    pool = Pool(pool_cfg)
    roles = {w.url: w.view(0.0).role for w in pool.workers.values()}
    assert roles == {P: Role.PREFILL, D: Role.DECODE, M: Role.MIXED}
    assert pool.pd_router is not None and pool.pd_router.settings.roles == SGLANG_ROLES
    assert pool.pd_router.settings.transfer_setup_s == 0.002


def test_a_rediscovered_static_pool_keeps_its_roles_and_discovery_labels_win() -> None:
    pool = Pool(parse_config(config(prefill_workers=[P], decode_workers=[D], pd={})).pools[0])
    assert pool.pd_router is not None and pool.pd_router.settings.roles == VLLM_ROLES
    view_before = pool.workers[next(iter(pool.workers))].view(0.0)
    pool.set_urls([P, D], {P: None, D: None})  # what the fleet's static source reports
    assert {w.url: w.role for w in pool.workers.values()} == {P: "prefill", D: "decode"}
    pool.set_urls([P, D, M], {P: "decode", M: "both"})
    assert {w.url: w.view(0.0).role for w in pool.workers.values()} == {
        P: Role.DECODE,
        D: Role.DECODE,
        M: Role.MIXED,
    }
    # A role change is a new view (views are cached until something in them changes).
    assert pool.workers[next(iter(pool.workers))].view(0.0) is not view_before


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"prefill_workers": [P], "decode_workers": [D]}, "need a 'pd' section"),
        ({"workers": [P], "decode_workers": [P], "pd": {}}, "listed twice"),
        ({"dns": {"name": "w", "port": 80}, "pd": {}}, "DNS discovery knows no roles"),
        ({"kubernetes": {"selector": "app=w", "port": 80}, "pd": {}}, "kubernetes.role_label"),
        ({"workers": [P], "pd": {"protocol": "nixl"}}, "pools.0.pd.protocol"),
        ({"workers": [P], "pd": {"transfer": {"bandwidth_bytes_per_s": 0}}}, "bandwidth_bytes_per_s"),
        ({"workers": [P], "pd": {"bootstrap": 1}}, "pools.0.pd.bootstrap"),
        ({"decode_workers": ["127.0.0.1:2"], "pd": {}}, "must start with http"),
        ({"workers": [P], "pd": {"protocol": "sglang", "mode": "holder_prefill"}}, "needs protocol vllm"),
        ({"workers": [P], "pd": {"mode": "holder_prefill", "holder_share": 1}}, "pools.0.pd.holder_share"),
        ({"workers": [M], "decode_workers": [D], "pd": {"mode": "holder_prefill"}}, "mixed workers only"),
        (
            {
                "kubernetes": {"selector": "app=w", "port": 80, "role_label": "r"},
                "pd": {"mode": "holder_prefill"},
            },
            "drop kubernetes.role_label",
        ),
    ],
)
def test_bad_pd_sections_name_the_problem(pool: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(config(**pool))


def test_kubernetes_pools_split_by_their_role_label() -> None:
    k8s = {"selector": "app=w", "port": 80, "role_label": "kvgate.io/role"}
    cfg = parse_config(config(kubernetes=k8s, pd={"protocol": "vllm"}))
    assert cfg.pools[0].pd is not None and cfg.pools[0].static_urls == []


def test_the_documented_pd_pool_is_valid() -> None:
    block = re.search(r"### Prefill/decode pools.*?```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    pool = PoolConfig.model_validate(yaml.safe_load(block.group(1))["pools"][0])
    assert pool.pd is not None and pool.pd.protocol == "vllm" and len(pool.decode_workers) == 2


@pytest.mark.parametrize(
    "source",
    [
        {"workers": [M, P]},
        {"dns": {"name": "w", "port": 80}},
        {"kubernetes": {"selector": "app=w", "port": 80}},
    ],
)
def test_a_holder_prefill_pool_of_mixed_workers_needs_no_roles(source: dict[str, Any]) -> None:
    cfg = parse_config(config(**source, pd={"mode": "holder_prefill", "holder_share": 0.6}))
    pool = Pool(cfg.pools[0])
    assert pool.pd_router is not None
    settings = pool.pd_router.settings
    assert settings.mode == "holder_prefill" and settings.holder_share == 0.6 and settings.roles == VLLM_ROLES
    assert all(w.view(0.0).role == Role.MIXED for w in pool.workers.values())
