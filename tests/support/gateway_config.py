"""Gateway configs written by tests: the key secret, tenants with hashed keys, the YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gateway.auth import hash_api_key

# At least 32 bytes: the gateway refuses a shorter key-hash secret.
SECRET = b"e2e-test-secret-for-key-hashes-32"


def pd_pool(prefill: list[str], decode: list[str], protocol: str = "vllm", **settings: Any) -> dict[str, Any]:
    """Pool `p` serving model `m` on these prefill and decode workers, in `protocol`, splitting
    whenever a pair is free (`conditional` off); `settings` are the pool's other keys."""
    pd = {"protocol": protocol, "conditional": False}
    return {
        "name": "p",
        "models": ["m"],
        "prefill_workers": prefill,
        "decode_workers": decode,
        "pd": pd,
        **settings,
    }


def tenant(name: str, key: str, secret: bytes = SECRET, **extra: Any) -> dict[str, Any]:
    """A tenant entry whose API key `key` is accepted by a gateway holding `secret`."""
    return {"name": name, "api_key_hashes": [hash_api_key(secret, key)], **extra}


def write_gateway_config(
    path: Path, pools: list[dict[str, Any]], tenants: list[dict[str, Any]], **extra: Any
) -> Path:
    config = {"pools": pools, "tenants": tenants, **extra}
    path.write_text(yaml.safe_dump(config))
    return path


# A worker address nothing listens on (the discard port): a pool that only needs to exist.
UNREACHABLE_WORKER = "http://127.0.0.1:9"


def idle_gateway_config(path: Path, key: str, **extra: Any) -> Path:
    """A gateway config whose one pool `p` (model `m`) has a worker nothing listens on, and one
    tenant `t` with API key `key`: for tests of the gateway's processes, not of routing."""
    pools = [{"name": "p", "models": ["m"], "workers": [UNREACHABLE_WORKER]}]
    return write_gateway_config(path, pools, [tenant("t", key)], **extra)
