"""A DNS pool's settings pass through the chart to the gateway config: `workers.dns.emptyAfter`
is the config's `dns.empty_after` (answers of no addresses in a row that empty the pool), and
`emptyAfterSeconds` its `dns.empty_after_s` (the least time those answers span)."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from gateway.config import parse_config
from tests.helm.chart import gateway_config, render


def _dns_pool(**dns: Any) -> dict[str, Any]:
    return {"name": "p", "models": ["m"], "workers": {"dns": {"name": "vllm.llm.svc", "port": 8000, **dns}}}


def test_empty_after_reaches_the_gateway_config() -> None:
    rendered = gateway_config(
        render({"pools": [_dns_pool(refreshSeconds=1, emptyAfter=5, emptyAfterSeconds=0)]})
    )
    (pool,) = rendered["pools"]
    assert pool["dns"] == {
        "name": "vllm.llm.svc",
        "port": 8000,
        "scheme": "http",
        "refresh_s": 1,
        "empty_after": 5,
        "empty_after_s": 0,
    }
    dns = parse_config(rendered).pools[0].dns
    assert dns is not None and dns.empty_after == 5 and dns.empty_after_s == 0


def test_empty_after_unset_keeps_the_gateway_default() -> None:
    rendered = gateway_config(render({"pools": [_dns_pool()]}))
    assert "empty_after" not in rendered["pools"][0]["dns"]
    assert "empty_after_s" not in rendered["pools"][0]["dns"]
    dns = parse_config(rendered).pools[0].dns
    assert dns is not None and dns.empty_after == 2 and dns.empty_after_s == 10


@pytest.mark.parametrize("value", [0, 101, 1.5, "3"])
def test_empty_after_out_of_range_fails_the_install(value: Any) -> None:
    with pytest.raises(helm_python.HelmError, match="emptyAfter"):
        render({"pools": [_dns_pool(emptyAfter=value)]})


@pytest.mark.parametrize("value", [-1, 3601, "3"])
def test_empty_after_seconds_out_of_range_fails_the_install(value: Any) -> None:
    with pytest.raises(helm_python.HelmError, match="emptyAfterSeconds"):
        render({"pools": [_dns_pool(emptyAfterSeconds=value)]})
