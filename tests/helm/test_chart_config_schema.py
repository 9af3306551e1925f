"""values.schema.json checks `config`, `pools[].extra` and `pools[].workers.kubernetes.extra`
against the gateway config's own models (helm/generate_schema.py), and bounds the chart's own values
that become gateway fields as those fields are, so a misspelt key or a value the gateway refuses
fails the install rather than crashlooping the pods; so does a pool or tenant name given twice. The
committed schema is the generated one."""

from __future__ import annotations

import importlib.util
import json
from types import ModuleType
from typing import Any

import helm_python
import pytest

from gateway.config import parse_config
from tests.helm.chart import CHART, POOL, TENANT, gateway_config, render

GENERATOR = CHART.parent / "generate_schema.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_schema", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_schema_is_the_generated_one() -> None:
    generator = _generator()
    committed = (CHART / "values.schema.json").read_text()
    assert committed == generator.render(generator.generated(json.loads(committed))), (
        "values.schema.json is out of date: run python helm/generate_schema.py"
    )
    assert generator.main(["--check"]) == 0


KUBERNETES = {"kubernetes": {"selector": {"app": "vllm"}, "port": 8000}}
OTHER_HASH = "hmac-sha256:" + "cd" * 32
# A pool as the gateway config spells it (under `config`).
POOL_CONFIG: dict[str, Any] = {"name": "p", "models": ["m"], "workers": ["http://10.0.0.9:8000"]}


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (
            {"config": {"drain": {"deadline_secs": 120}}},
            "at '/config/drain': additional properties 'deadline_secs'",
        ),
        ({"config": {"limts": {}}}, "at '/config': additional properties 'limts'"),
        ({"config": {"limits": {"max_body_bytes": "8MiB"}}}, "at '/config/limits/max_body_bytes'"),
        ({"config": {"drain": {"deadline_s": 0}}}, "at '/config/drain/deadline_s'"),
        ({"config": {"log_level": "verbose"}}, "at '/config/log_level'"),
        (
            {"pools": [POOL | {"extra": {"max_inflight_per_worker": 8}}]},
            "at '/pools/0/extra': additional properties 'max_inflight_per_worker'",
        ),
        (
            {"pools": [POOL | {"extra": {"timeouts": {"read": 600}}}]},
            "at '/pools/0/extra/timeouts': additional properties 'read'",
        ),
        (
            {
                "kubernetesDiscovery": {"enabled": True},
                "pools": [
                    POOL | {"workers": {"kubernetes": KUBERNETES["kubernetes"] | {"extra": {"resync_s": 30}}}}
                ],
            },
            "at '/pools/0/workers/kubernetes/extra': additional properties 'resync_s'",
        ),
    ],
)
def test_a_misspelt_gateway_key_fails_the_install(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm_python.HelmError, match=needle):
        render(values)


def test_gateway_keys_pass_and_reach_the_gateway() -> None:
    """Partial blocks are valid (they are merged over the generated config), and so are fields
    whose validators take other shapes than their type (a selector as a mapping)."""
    extra = {"max_in_flight_per_worker": 8, "timeouts": {"read_s": 900}, "breaker": {"cooldown_s": 2}}
    kubernetes = KUBERNETES["kubernetes"] | {"extra": {"max_pods": 64, "kv_events_port": "kv-events"}}
    docs = render(
        {
            "kubernetesDiscovery": {"enabled": True},
            "config": {"drain": {"shutdown_delay_s": 1}, "limits": {"max_client_connections": 100}},
            "pools": [
                POOL | {"extra": extra},
                {"name": "k8s", "models": ["other"], "workers": {"kubernetes": kubernetes}},
            ],
        }
    )
    config = parse_config(gateway_config(docs))
    assert config.drain.shutdown_delay_s == 1 and config.limits.max_client_connections == 100
    static, k8s = config.pools
    assert static.max_in_flight_per_worker == 8 and static.timeouts.read_s == 900
    assert k8s.kubernetes is not None and k8s.kubernetes.max_pods == 64


# ---------------------------------------------------------------- the chart's own values


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"sync": {"batchMaxItems": 8193}}, "at '/sync/batchMaxItems'"),
        ({"sync": {"queueMaxItems": 0}}, "at '/sync/queueMaxItems'"),
        (
            {
                "kubernetesDiscovery": {"enabled": True},
                "pools": [
                    POOL | {"workers": {"kubernetes": KUBERNETES["kubernetes"] | {"namespace": "Inference"}}}
                ],
            },
            "at '/pools/0/workers/kubernetes/namespace'",
        ),
        (
            {
                "kubernetesDiscovery": {"enabled": True},
                "pools": [
                    POOL | {"workers": {"kubernetes": KUBERNETES["kubernetes"] | {"namespace": "n" * 64}}}
                ],
            },
            "at '/pools/0/workers/kubernetes/namespace'",
        ),
    ],
)
def test_a_chart_value_the_gateway_would_refuse_fails_the_install(
    values: dict[str, Any], needle: str
) -> None:
    """The camelCase values the chart copies into the gateway config are bounded as the gateway's
    fields are (helm/generate_schema.py, BOUNDS): refused at install, not by crashlooping pods."""
    with pytest.raises(helm_python.HelmError, match=needle):
        render(values)


def test_chart_values_at_the_gateways_bounds_reach_it() -> None:
    kubernetes = KUBERNETES["kubernetes"] | {"namespace": "inference-2"}
    docs = render(
        {
            "sync": {"batchMaxItems": 8192},
            "kubernetesDiscovery": {"enabled": True},
            "pools": [POOL | {"workers": {"kubernetes": kubernetes}}],
        }
    )
    config = parse_config(gateway_config(docs))
    assert config.sync.batch_max_items == 8192
    assert config.pools[0].kubernetes is not None and config.pools[0].kubernetes.namespace == "inference-2"


def test_every_bounded_chart_value_names_a_gateway_field() -> None:
    generator = _generator()
    schema = json.loads((CHART / "values.schema.json").read_text())
    for path, (model, field) in generator.BOUNDS.items():
        node = schema
        for step in path:
            node = node[step]
        bounds = generator.field_bounds(schema["$defs"], model, field)
        assert bounds, (path, model, field)
        assert {k: v for k, v in node.items() if k in generator.BOUND_KEYWORDS} == bounds, path


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"pools": [POOL, POOL | {"models": ["other"]}]}, 'pools: "default" names two pools'),
        (
            {"tenants": [TENANT, TENANT | {"apiKeyHashes": [OTHER_HASH]}]},
            'tenants: "team-a" names two tenants',
        ),
        # Also when `config` replaces the generated list.
        (
            {"config": {"pools": [POOL_CONFIG, POOL_CONFIG | {"models": ["other"]}]}},
            'pools: "p" names two pools',
        ),
        # A model served by two pools, an API key hash of two tenants (not printed).
        (
            {"pools": [POOL, POOL | {"name": "second"}]},
            'pools: model "[^"]+" is in both "default" and "second"',
        ),
        (
            {"tenants": [TENANT, TENANT | {"name": "team-b"}]},
            'tenants: an API key hash is in both "team-a" and "team-b"',
        ),
    ],
)
def test_a_name_given_twice_fails_the_install(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm_python.HelmError, match=needle):
        render(values)
