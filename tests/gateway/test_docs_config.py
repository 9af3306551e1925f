import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from gateway.config import GatewayConfig, load_config, parse_config
from prompt_normalizer.normalizer import NormalizerConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"
HASH = "hmac-sha256:" + "0" * 64


def test_the_documented_example_config_is_valid() -> None:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    cfg = parse_config(yaml.safe_load(block.group(1)))
    assert [p.name for p in cfg.pools] == ["llama", "qwen"]
    assert cfg.pools[1].dns is not None and cfg.pools[1].kv_events_endpoint == "tcp://{host}:5557"
    assert cfg.drain.shutdown_delay_s == 5 and cfg.tenants[1].isolation == "public"


def gateway_examples() -> Iterator[tuple[str, str]]:
    """Each YAML block of the docs written in the gateway config's terms (a whole file, or the
    blocks it shows), named by page and line; Helm values, Kubernetes objects and the policy file
    have tests of their own."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for found in re.finditer(r"^```yaml\n(.*?)^```", text, re.S | re.M):
            raw = yaml.safe_load(found.group(1))
            if not isinstance(raw, dict):
                continue  # a list: a workers file (`workers_file`), not a config
            if not set(raw) <= set(GatewayConfig.model_fields) or not isinstance(raw.get("pools", []), list):
                continue
            # The chart's pools find their workers under `workers: {urls, dns, kubernetes}`.
            if all(isinstance(pool.get("workers", []), list) for pool in raw.get("pools", [])):
                yield f"{page.name}:{text.count(chr(10), 0, found.start()) + 1}", found.group(1)


def whole(raw: dict[str, Any]) -> dict[str, Any]:
    """A shown block made a whole config: a pool and a tenant when it has none."""
    pool = {"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:8000"]}
    return {"pools": [pool], "tenants": [{"name": "t", "api_key_hashes": [HASH]}], **raw}


def test_every_gateway_config_example_in_the_docs_loads(tmp_path: Path) -> None:
    examples = dict(gateway_examples())
    assert len(examples) >= 5, examples.keys()
    refused = {}
    for where, text in examples.items():
        # Placeholders such as `<release>` and `<namespace>` stand for names.
        text = re.sub(r"<([a-z ]+)>", lambda m: m.group(1).replace(" ", "-"), text)
        raw = yaml.safe_load(text)
        path = tmp_path / "gateway.yaml"
        path.write_text(text if "pools" in raw and "tenants" in raw else yaml.safe_dump(whole(raw)))
        try:
            load_config(path)
        except ValueError as exc:
            refused[where] = str(exc)
    assert refused == {}


def test_the_normalizer_examples_are_valid() -> None:
    text = (ROOT / "docs" / "normalizer.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)]
    sections = [b["normalizer"] for b in blocks if set(b) == {"normalizer"}]
    assert sections
    for section in sections:
        NormalizerConfig.model_validate(section)


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
