"""Replica sync for one gateway process: the policy's sink, the publish task, the broker link.

Owned by the app lifespan (`start` / `stop`). The publish task wakes when the queue gets its first
item (or when a full load snapshot is due), waits `batch_interval_s` so a burst shares one batch,
and sends batches while the link is up; while it is down, items wait in the bounded queue. Peers'
batches are applied on the event loop as they arrive, between requests. While peers' holdings
wait for their worker to be discovered here (`parking`), a third task looks every
`ADOPT_POLL_S` for discovery having added it; a new worker is not routable before its first
health check answers, which takes about as long.

Tenants' quotas are shared as well (`quotas`): a limiter's charge wakes the publish task, which
sends what each tenant's limiter has not told the peers yet with the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from gateway.config.sync import SyncConfig
from gateway.quotas import TOLD_GAP_S, TenantLimiter, Usage
from gateway.sync.codec import SyncBatch, encode
from gateway.sync.deployment import fingerprints, published
from gateway.sync.link import open_link
from gateway.sync.publisher import SyncPublisher
from gateway.sync.signing import BatchKey
from gateway.sync.subscriber import SyncSubscriber
from policies.base import RoutingPolicy
from policies.peer_sync import PeerLoad, SupportsPeerSync

if TYPE_CHECKING:
    from gateway.registry import Registry
    from gateway.routing import Routing

log = logging.getLogger("kvgate.sync")

_MAX_BATCHES_PER_WAKE = 8  # then yield to requests; the rest goes at the next wake
_LAST_WORD_S = 0.5  # at most, for the last batch at stop
_DOWN_POLL_S = 0.1
ADOPT_POLL_S = 0.02


def default_origin() -> str:
    """This process's name on the bus: host, pid and a random part (a restarted process with the
    same pid is a new peer, whose refs start again)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class SyncService:
    """Publishes this gateway's decisions and load, applies its peers'."""

    def __init__(
        self,
        registry: Registry,
        routing: Routing,
        config: SyncConfig,
        origin: str | None = None,
        *,
        secret: bytes,
        limiters: Mapping[str, TenantLimiter] | None = None,
    ) -> None:
        """`secret`: the gateway's key-hash secret, which keys its pools' fingerprints (a gateway
        of another secret is of another deployment, `deployment`) and, through a sub-secret of its
        own, seals its batches (`signing`): peers apply only batches sealed under it. `limiters`:
        the tenants' quota state by tenant name, shared with the peers (none: quotas stay this
        gateway's own)."""
        if config.url is None:
            raise ValueError("sync.url is not set")
        self.registry = registry
        self.routing = routing  # the policy's one holder: read at each use, as a reload swaps it
        self.config = config
        self.origin = origin or default_origin()
        self.key = BatchKey(secret)
        pools = fingerprints(((name, pool.config.models) for name, pool in registry.pools.items()), secret)
        self.publisher = SyncPublisher(self.origin, config, published(pools))
        self.limiters = {name: x for name, x in (limiters or {}).items() if x.limited}
        self._quotas_changed: set[str] = set()  # tenants whose limiter has something to tell
        self.subscriber = SyncSubscriber(
            self.origin,
            registry,
            config.peer_timeout_s,
            routing.metrics,
            secret=secret,
            share_calibration=config.share_calibration,
            limiters=self.limiters,
        )
        self.link = open_link(config, self.origin, self._on_message)
        self.published_batches = 0
        self.failed_batches = 0
        # Items of the batches the link took, counted once it did: the publisher counts an item
        # when it goes into a batch, before the publish that may fail, and a count read meanwhile
        # would go back down after a failure.
        self.published_items = 0
        self.lost_items = 0
        self._tasks: list[asyncio.Task[None]] = []

    def attach(self, policy: RoutingPolicy) -> None:
        """Make `policy` publish through this service (at start, and after a policy reload)."""
        if isinstance(policy, SupportsPeerSync):
            policy.set_sync_sink(
                self.publisher.sink, calibration=self.config.share_calibration, origin=self.origin
            )

    async def _on_message(self, data: bytes) -> None:
        await self.subscriber.on_message(data, self._policy)

    def _policy(self) -> RoutingPolicy:
        return self.routing.policy  # the current one: a reload may swap it between two chunks

    async def start(self) -> None:
        self.attach(self.routing.policy)
        # Charges wait at most a few batches before they count as an outage's (`quotas.TOLD_GAP_S`).
        told_gap_s = max(TOLD_GAP_S, 4 * self.config.batch_interval_s)
        for name, limiter in self.limiters.items():
            limiter.notify = functools.partial(self._quota_changed, name)
            limiter.told_gap_s = told_gap_s
        self._tasks = [
            asyncio.create_task(self.link.run(), name="sync-link"),
            asyncio.create_task(self._publish_loop(), name="sync-publish"),
            asyncio.create_task(self._adopt_loop(), name="sync-adopt"),
        ]

    def _quota_changed(self, tenant: str) -> None:
        """A limiter's `notify`: its tenant has something to tell, with the next batch."""
        self._quotas_changed.add(tenant)
        self.publisher.ready.set()

    async def stop(self) -> None:
        """Stop publishing and applying. A last batch, when the broker is there, tells the peers
        what this gateway charged last and that it has no request in flight any more (else they
        would count its requests until it had been silent for `peer_timeout_s`)."""
        policy = self.routing.policy
        if isinstance(policy, SupportsPeerSync):
            policy.set_sync_sink(None)
        link_task, others = (self._tasks[0], self._tasks[1:]) if self._tasks else (None, [])
        await self._cancel(others)  # nothing publishes meanwhile: batches go out in order
        for limiter in self.limiters.values():
            limiter.notify = None
        if self.limiters and self.link.connected:
            with contextlib.suppress(Exception):  # shutdown never waits on the broker
                async with asyncio.timeout(_LAST_WORD_S):
                    await self._send(time.monotonic(), every_tenant=True)
        await self._cancel([link_task] if link_task is not None else [])
        self._tasks.clear()
        await self.link.close()

    @staticmethod
    async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=2.0)  # shutdown never waits on the broker
            if stuck:
                log.warning("sync tasks did not stop in time", extra={"tasks": len(stuck)})

    def _loads(self) -> Iterator[PeerLoad]:
        for pool in self.registry.pools.values():
            for w in pool.workers.values():
                yield PeerLoad(
                    pool.name,
                    w.worker_id,
                    w.in_flight,
                    w.prefill_tokens,
                    w.decode_tokens,
                    w.decode_context,
                    w.prefill_pairs,
                )

    async def _publish_loop(self) -> None:
        cfg = self.config
        publisher = self.publisher
        while True:
            wait_s = publisher.full_load_in_s(time.monotonic())
            if publisher.prefill_published:
                # A prefill ending queues no item, but the peers must hear of it: while they count
                # prefill tokens of ours, look for changed loads every batch interval (a batch goes
                # out only when one changed).
                wait_s = 0.0
            if wait_s > 0:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await publisher.ready.wait()
            await asyncio.sleep(cfg.batch_interval_s)
            now_s = time.monotonic()
            self.subscriber.expire(now_s)
            if not self.link.connected:
                await asyncio.sleep(_DOWN_POLL_S)  # items wait in the bounded queue
                continue
            try:
                await self._send(now_s)
            except Exception:  # a bug here must not end publishing
                log.exception("sync publish round failed")

    async def _adopt_loop(self) -> None:
        sub = self.subscriber
        while True:
            await sub.parked_any.wait()
            await asyncio.sleep(ADOPT_POLL_S)
            try:
                sub.parked.expire(time.monotonic())
                await sub.adopt(self._policy)
            except Exception:  # a bug here must not end adopting
                log.exception("applying parked sync holdings failed")
            if not sub.parked:
                sub.parked_any.clear()

    def _usage(self, full: bool, now_s: float) -> Iterator[tuple[str, Usage]]:
        """What the tenants' limiters have not told the peers yet (`TenantLimiter.unshared`):
        those that changed since the last batch, or every one for a full load snapshot."""
        names = self.limiters.keys() if full else self._quotas_changed
        for name in list(names):
            usage = self.limiters[name].unshared(full, now_s)
            if usage is not None:
                yield name, usage
        self._quotas_changed.clear()

    async def _send(self, now_s: float, every_tenant: bool = False) -> None:
        publisher = self.publisher
        # At most one row a tenant waits, but a gateway's last word takes every tenant's.
        if self.limiters and (every_tenant or not publisher.usage_pending):
            full = every_tenant or publisher.full_load_due(now_s)
            publisher.share_usage(self._usage(full, now_s))
        for _ in range(_MAX_BATCHES_PER_WAKE):
            batch = publisher.next_batch(self._loads(), now_s, self.link.max_payload)
            if batch is None:
                return
            if await self.link.publish(encode(batch, self.key)):
                self.published_batches += 1
                self.published_items += len(batch.items)
            else:
                self.failed_batches += 1
                self.lost_items += len(batch.items)
                self._unsend(batch, now_s)
            if not publisher.queued and not publisher.usage_pending:
                return

    def _unsend(self, batch: SyncBatch, now_s: float) -> None:
        """The quota rows of a batch that was not published go back to their limiters, to be
        told with a later batch (what they tell is a sum since the last row: nothing is lost)."""
        for tenant, usage in batch.usage:
            limiter = self.limiters.get(tenant)
            if limiter is not None:
                limiter.unsend(usage, now_s)
                self._quota_changed(tenant)

    def counters(self) -> dict[str, int]:
        """Monotonic counts for the metrics."""
        sub = self.subscriber.stats
        parked = self.subscriber.parked.stats
        return {
            "published_batches": self.published_batches,
            "published_items": self.published_items,
            "applied_batches": sub.batches,
            "applied_items": sub.items,
            "dropped_queue_full": self.publisher.dropped,
            "dropped_oversized": self.publisher.oversized,
            "dropped_publish_failed": self.lost_items,
            "dropped_bad_signature": sub.bad_signature,
            "dropped_malformed": sub.malformed,
            "dropped_clock_skew": sub.clock_skew,
            "dropped_unknown_worker": sub.unknown_worker,
            "dropped_unknown_tenant": sub.unknown_tenant,
            "late_quota_rows": sub.late_quota,
            "dropped_stale_quota": sub.stale_quota,
            "parked_holdings": parked.parked,
            "parked_applied": parked.applied,
            "parked_expired": parked.expired,
            "parked_evicted": parked.evicted,
            "parked_withdrawn": parked.withdrawn,
            "truncated_holdings": sub.truncated,
            "dropped_slow_consumer": self.link.slow_consumer,
            "lost_batches": self.subscriber.sequences.lost,
            "dropped_replayed": self.subscriber.sequences.replayed,
            "dropped_other_deployment": sub.other_deployment,
            "dropped_block_size": sub.block_size,
            "apply_failed": sub.failed,
            "broker_errors": self.link.errors,
            "broker_connects": self.link.connects,
        }

    def refresh_metrics(self) -> None:
        m = self.routing.metrics
        m.sync_peers.set(self.subscriber.loads.peers())
        m.sync_connected.set(1 if self.link.connected else 0)
        m.sync_queued.set(self.publisher.queued)
        policy = self.routing.policy
        m.sync_unseen.set(policy.unseen_peer_dispatches if isinstance(policy, SupportsPeerSync) else 0.0)
        for name, value in self.counters().items():
            m.sync_events.labels(name).value = float(value)
