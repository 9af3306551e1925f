"""Tenants' quotas hold for the release only while the gateways share their charges (docs/sync.md,
"Quotas"): with sync off, every gateway enforces the whole quota, so the chart refuses quotas over
more than one possible replica, and notes the risk when it cannot see the config."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.helm.chart import TENANT, gateway_config, notes, render

OFF = {"sync": {"enabled": False}}
LIMITED = [TENANT | {"name": "team-b", "rpm": 600}]


@pytest.mark.parametrize(
    "values",
    [
        {"tenants": LIMITED},  # replicaCount: 2 by default
        {"tenants": [TENANT | {"maxConcurrent": 8}], "replicaCount": 3},
        {"tenants": [TENANT | {"tpm": 100_000}], "replicaCount": 1, "autoscaling": {"enabled": True}},
        # Quotas given through `config` count too: they are what the gateway enforces.
        {
            "config": {
                "tenants": [{"name": "t", "api_key_hashes": TENANT["apiKeyHashes"], "quotas": {"rpm": 60}}]
            }
        },
    ],
)
def test_quotas_over_several_gateways_without_sync_fail_the_install(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmError, match=r"quotas .* sync is off .* whole quota") as failed:
        render(OFF | values)
    assert "sync.enabled" in str(failed.value)


@pytest.mark.parametrize(
    "values",
    [
        {"tenants": LIMITED},  # sync on (the default)
        OFF | {"tenants": LIMITED, "replicaCount": 1},
        OFF
        | {
            "tenants": LIMITED,
            "replicaCount": 1,
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1},
        },
        OFF | {"tenants": [TENANT], "replicaCount": 4},  # no quota: nothing to share
        OFF | {"tenants": LIMITED, "config": {"sync": {"url": "nats://nats.shared:4222"}}},  # shared anyway
    ],
)
def test_quotas_that_hold_for_the_release_render(values: dict[str, Any]) -> None:
    gateway_config(render(values))


def test_a_config_the_chart_cannot_see_gets_a_note() -> None:
    own = {"configSecret": {"existingSecret": "own-config"}, "tenants": []}
    assert "whole quota" in notes(OFF | own)
    assert "whole quota" not in notes(OFF | own | {"replicaCount": 1})
    assert "whole quota" not in notes(own)
