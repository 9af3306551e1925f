"""The applying half: a peer's batch goes to the policy (holdings, outcomes) and the registry (load).

Batches from this gateway itself are ignored (the broker is also told not to echo them). A batch
that does not decode is counted and dropped; a gap in a peer's sequence numbers counts the batches
lost on the way. Applying never raises into the transport: whatever goes wrong, the gateway keeps
routing on what it knows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync.codec import MalformedBatch, SyncBatch, decode
from policies.base import RoutingPolicy, WorkerId
from policies.peer_sync import PeerLoads, SupportsPeerSync

log = logging.getLogger("kvgate.sync")


@dataclass(slots=True)
class ApplyStats:
    """What the subscriber did, for the metrics (monotonic counters)."""

    batches: int = 0
    items: int = 0
    malformed: int = 0
    lost_batches: int = 0
    failed: int = 0


class SyncSubscriber:
    """Applies peers' batches to the current policy and folds their load into the registry."""

    def __init__(
        self, origin: str, registry: Registry, peer_timeout_s: float, metrics: GatewayMetrics
    ) -> None:
        self.origin = origin
        self.registry = registry
        self._lag = metrics.sync_lag.labels()
        self.loads = PeerLoads(peer_timeout_s)
        self.stats = ApplyStats()
        self._last_seq: dict[str, int] = {}

    def on_message(self, data: bytes, policy: RoutingPolicy) -> None:
        try:
            batch = decode(data)
        except MalformedBatch as exc:
            self.stats.malformed += 1
            log.warning("malformed sync batch dropped", extra={"error": str(exc)})
            return
        if batch.origin == self.origin:
            return
        try:
            self.apply(batch, policy, time.monotonic())
        except Exception:  # a bug here must not end the subscription
            self.stats.failed += 1
            log.exception("applying a sync batch failed", extra={"peer": batch.origin})

    def apply(self, batch: SyncBatch, policy: RoutingPolicy, now_s: float) -> None:
        stats = self.stats
        last = self._last_seq.get(batch.origin)
        if last is not None and batch.seq > last + 1:
            stats.lost_batches += batch.seq - last - 1
        if last is None or batch.seq > last:
            self._last_seq[batch.origin] = batch.seq
        if len(self._last_seq) > 4096:
            self._last_seq.clear()  # bounded against churning peers; a gap may go uncounted
        if isinstance(policy, SupportsPeerSync):
            for item in batch.items:
                policy.apply_peer(batch.origin, item, now_s)
        stats.items += len(batch.items)
        stats.batches += 1
        # Wall clocks: across hosts this includes their skew (same host: the true lag).
        self._lag.observe(max(0.0, time.time() - batch.sent_wall_s))
        for pool, worker in self.loads.note(batch.origin, batch.loads, now_s, full=batch.full_load):
            self._refresh(pool, worker)

    def expire(self, now_s: float) -> None:
        """Forget peers not heard from within the timeout (and their load)."""
        for pool, worker in self.loads.expire(now_s):
            self._refresh(pool, worker)
        for origin in [o for o in self._last_seq if not self.loads.heard_from(o)]:
            del self._last_seq[origin]

    def _refresh(self, pool_name: str, worker_id: WorkerId) -> None:
        pool = self.registry.pools.get(pool_name)
        worker = None if pool is None else pool.workers.get(worker_id)
        if worker is not None:
            worker.note_peer_load(self.loads.total(pool_name, worker_id))
