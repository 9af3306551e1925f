import re
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import yaml
from pydantic import BaseModel

from gateway.config import GatewayConfig, parse_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_documented_example_config_is_valid() -> None:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    cfg = parse_config(yaml.safe_load(block.group(1)))
    assert [p.name for p in cfg.pools] == ["llama", "qwen"]
    assert cfg.pools[1].dns is not None and cfg.pools[1].kv_events_endpoint == "tcp://{host}:5557"
    assert cfg.drain.shutdown_delay_s == 5 and cfg.tenants[1].isolation == "public"


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        nested = [a for a in (field.annotation, *get_args(field.annotation)) if _is_model(a)]
        if nested and name != "normalizer":  # a pool's normalizer block: docs/normalizer.md
            yield from _leaf_keys(nested[0], f"{prefix}{name}.")
        elif name != "normalizer":
            yield prefix + name


def _is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def test_every_config_key_is_documented() -> None:
    doc = DOC.read_text()
    for key in _leaf_keys(GatewayConfig):
        # Pool, tenant and Kubernetes fields are written relative to their own table.
        for block in ("pools.kubernetes.", "pools.", "tenants."):
            key = key.removeprefix(block)
        assert f"`{key}`" in doc, f"docs/config.md does not document `{key}`"
