"""values.schema.json checks `config`, `pools[].extra` and `pools[].workers.kubernetes.extra`
against the gateway config's own models (helm/generate_schema.py), so a misspelt key fails the
install rather than crashlooping the pods; and the committed schema is the generated one."""

from __future__ import annotations

import importlib.util
import json
from types import ModuleType
from typing import Any

import helm_python
import pytest

from gateway.config import parse_config
from tests.helm.chart import CHART, POOL, gateway_config, render

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
