"""The `queue` block of a pool: its waiting room when every worker is at its cap."""

from __future__ import annotations

from typing import Literal

from gateway.config.base import Frozen, PositiveFloat, PositiveInt


class QueueConfig(Frozen):
    """The pool's waiting room (gateway/queueing.py): a request that finds every routable worker
    at `max_in_flight_per_worker` waits here for a free slot instead of failing. Tenants share
    the freed slots by their `weight`; within a tenant, vLLM's `priority` (lower first) goes first.
    Beyond `max_per_tenant` waiting requests of one tenant: 429; beyond `max_requests` in the
    pool: 503; waiting longer than `timeout_s`: 503 (all with `Retry-After`). `order: fifo` serves
    arrivals in order whatever the tenant (for comparison; one tenant's flood then delays all)."""

    enabled: bool = True
    max_requests: PositiveInt = 1024
    max_per_tenant: PositiveInt = 256
    timeout_s: PositiveFloat = 30.0
    order: Literal["fair", "fifo"] = "fair"
