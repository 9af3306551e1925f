"""Records of the prefix index: its sizing, a lookup's result, and one key's entry."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.base import WorkerId
from policies.records import record

CONFIRMED = math.inf


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Sizing of one pool's index. Capacities are in tokens, converted to index blocks per pool."""

    default_capacity_tokens: int = 430_000
    max_entries: int = 4_000_000
    namespace_share: float = 0.5
    speculative_ttl_s: float = 60.0
    granularity_blocks: int = 1
    max_workers: int = 1024
    recency_resolution_s: float = 1.0

    def __post_init__(self) -> None:
        if self.granularity_blocks < 1:
            raise ValueError("granularity_blocks must be >= 1")
        if self.max_entries < 1 or self.default_capacity_tokens < 0:
            raise ValueError("max_entries must be >= 1 and default_capacity_tokens >= 0")
        if not 0.0 < self.namespace_share <= 1.0:
            raise ValueError("namespace_share must be in (0, 1]")
        if self.speculative_ttl_s <= 0:
            raise ValueError("speculative_ttl_s must be > 0")
        if self.recency_resolution_s < 0:
            raise ValueError("recency_resolution_s must be >= 0")


@record
class PrefixMatch:
    """Every worker's matched prefix for one request, in request blocks (only workers with a match).

    `deepest_holder` is the most recent holder of the deepest matched block (SGLang's `last_tenant`).
    """

    blocks_by_worker: Mapping[WorkerId, int] = field(default_factory=dict)
    longest_blocks: int = 0
    deepest_holder: WorkerId | None = None

    def blocks(self, worker: WorkerId) -> int:
        return self.blocks_by_worker.get(worker, 0)


NO_MATCH = PrefixMatch()


class Entry:
    """One block key: its namespace and holders (worker → expiry; insertion order = recency)."""

    __slots__ = ("holders", "namespace", "spec")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.holders: dict[WorkerId, float] = {}
        self.spec = 0  # speculative holders, so lookups know when expiry must be checked
