"""The chart's per-pool worker API key (a Secret mounted as a file) and tenant weights."""

from __future__ import annotations

from gateway.config import parse_config
from tests.helm.chart import POOL, TENANT, container, gateway_config, pod_spec, render, validate_strictly


def test_a_pools_worker_key_secret_is_mounted_and_named_in_the_config() -> None:
    pools = [
        {**POOL, "name": "plain"},
        {**POOL, "name": "keyed", "models": ["other"], "workerApiKeySecret": {"name": "vllm-api-key"}},
        {**POOL, "name": "own-key", "models": ["third"], "workerApiKeySecret": {"name": "s", "key": "token"}},
    ]
    docs = render({"pools": pools, "tenants": [TENANT | {"weight": 2.5}]})
    validate_strictly(docs)
    cfg = gateway_config(docs)
    assert [p.get("worker_api_key_file") for p in cfg["pools"]] == [
        None,
        "/etc/kvgate/worker-keys/1/api-key",
        "/etc/kvgate/worker-keys/2/api-key",
    ]
    assert cfg["tenants"][0]["weight"] == 2.5
    parsed = parse_config(cfg)  # `kvgate serve` accepts what the chart renders
    assert parsed.tenants[0].weight == 2.5
    mounts = {m["name"]: m for m in container(docs)["volumeMounts"]}
    assert mounts["worker-key-1"] == {
        "name": "worker-key-1",
        "mountPath": "/etc/kvgate/worker-keys/1",
        "readOnly": True,
    }
    assert "subPath" not in mounts["worker-key-2"]
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert "worker-key-0" not in volumes
    assert volumes["worker-key-1"]["secret"] == {
        "secretName": "vllm-api-key",
        "items": [{"key": "api-key", "path": "api-key"}],
    }
    assert volumes["worker-key-2"]["secret"]["items"] == [{"key": "token", "path": "api-key"}]
    # The key itself never passes through the chart: no value of it in any rendered document.
    assert all("vllm-api-key" not in str(doc) for key, doc in docs.items() if key.startswith("Secret/"))


def test_no_worker_key_renders_no_mount() -> None:
    docs = render()
    assert not any(m["name"].startswith("worker-key") for m in container(docs)["volumeMounts"])
    assert "worker_api_key_file" not in gateway_config(docs)["pools"][0]
