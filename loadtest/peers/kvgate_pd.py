"""kvgate in front of a prefill/decode pool: the benchmark's gateway config with a `pd` pool.

It starts from `build_kvgate_command` (tenants, keys, policy file) and replaces the pool's
`workers` with `prefill_workers`, `decode_workers` and a `pd` section (docs/pd.md, docs/config.md
"Prefill/decode pools").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.peers.kvgate import build_kvgate_command
from loadtest.peers.launch import PeerCommand


@dataclass(frozen=True, slots=True)
class PdPool:
    """The workers of a prefill/decode pool and the protocol they speak; SGLang's prefill workers
    each have a bootstrap port (by URL)."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    protocol: str = "sglang"
    bootstrap_ports: Mapping[str, int] = field(default_factory=dict)

    def pool_fields(self) -> dict[str, Any]:
        pd: dict[str, Any] = {"protocol": self.protocol}
        if self.bootstrap_ports:
            pd["bootstrap_ports"] = dict(self.bootstrap_ports)
        return {
            "workers": [],
            "prefill_workers": list(self.prefill_urls),
            "decode_workers": list(self.decode_urls),
            "pd": pd,
        }


def build_kvgate_pd_command(
    *,
    policy: str,
    port: int,
    pd: PdPool,
    model: str,
    tenants: Sequence[str],
    seed: int,
    workdir: Path,
) -> PeerCommand:
    """The `serve` command of kvgate routing `pd` with `policy` choosing the prefill worker."""
    cmd = build_kvgate_command(
        policy=policy, port=port, worker_urls=[], model=model, tenants=tenants, seed=seed, workdir=workdir
    )
    assert cmd.config_text is not None
    config = yaml.safe_load(cmd.config_text)
    (pool,) = config["pools"]
    pool.update(pd.pool_fields())
    return dataclasses.replace(cmd, config_text=yaml.safe_dump(config, sort_keys=False))
