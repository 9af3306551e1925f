import re
from pathlib import Path

import yaml

from gateway.config import parse_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_documented_example_config_is_valid() -> None:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    cfg = parse_config(yaml.safe_load(block.group(1)))
    assert [p.name for p in cfg.pools] == ["llama", "qwen"]
    assert cfg.pools[1].dns is not None and cfg.pools[1].kv_events_endpoint == "tcp://{host}:5557"
    assert cfg.drain.shutdown_delay_s == 5 and cfg.tenants[1].isolation == "public"
