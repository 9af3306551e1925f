"""The Helm values docs/deploy.md shows render with the chart into a gateway config the gateway
accepts."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gateway.config import parse_config
from tests.helm.chart import KEY_HASH, gateway_config, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
# Values are YAML blocks that set chart keys (camelCase, or a pool's `workers: {...}`).
CHART_KEYS = {"image", "keyHashSecret", "kubernetesDiscovery", "tenants"}


def values_examples() -> Iterator[tuple[str, dict[str, Any]]]:
    text = DOC.read_text()
    for found in re.finditer(r"^( *)```yaml\n(.*?)^\1```", text, re.S | re.M):
        # `<64 hex>` stands for a key hash.
        raw = yaml.safe_load(textwrap.dedent(found.group(2)).replace("hmac-sha256:<64 hex>", KEY_HASH))
        pools = raw.get("pools", [])
        if CHART_KEYS & set(raw) or any(isinstance(pool.get("workers"), dict) for pool in pools):
            yield f"deploy.md:{text.count(chr(10), 0, found.start()) + 1}", raw


def test_every_values_example_renders_a_valid_gateway_config() -> None:
    examples = dict(values_examples())
    assert len(examples) >= 3, examples.keys()
    for where, values in examples.items():
        config = parse_config(gateway_config(render(values)))
        assert [pool.name for pool in config.pools] == [pool["name"] for pool in values["pools"]], where
