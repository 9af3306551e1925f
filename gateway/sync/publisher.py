"""The publishing half: the policy's sink feeds a bounded queue, batches are cut from it.

`sink` runs inside a request's dispatch, so it only appends to a deque: when the queue is full the
oldest item is dropped and counted (a peer then misses one holding, which its TTL or a later
dispatch of the same chain makes up for). Nothing here awaits; the service's task sends the
batches, so a slow or absent broker never holds a request.

A batch is also cut by size: the broker refuses a message over its `max_payload` (1 MiB by
default on NATS), so items are taken while an upper bound of their encoded size fits, and while
their keys stay within `PUBLISH_BATCH_KEYS` (peers refuse a batch of many more). An item that
alone would not fit (a holding of more than ~130k blocks), or that peers would refuse (a name or a
prompt beyond `codec.item_fits`), is dropped and counted as `oversized`.

Tenants' quota figures (`quotas.Usage`) handed over by the service (`share_usage`) go out with the
next batches, ahead of the items, at most `PUBLISH_BATCH_TENANTS` rows a batch; a row whose tenant
name peers would refuse (beyond `MAX_NAME_BYTES`) is dropped and counted as `oversized`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from gateway.config.sync import SyncConfig
from gateway.quotas import Usage
from gateway.sync.codec import (
    MAX_NAME_BYTES,
    MAX_WAIT_S,
    PUBLISH_BATCH_ITEMS,
    PUBLISH_BATCH_KEYS,
    PUBLISH_BATCH_TENANTS,
    SyncBatch,
    item_fits,
    name_fits,
)
from gateway.sync.signing import ENVELOPE_BYTES
from policies.base import WorkerId
from policies.peer_sync import NO_LOAD, LoadCounts, PeerCalibration, PeerHolding, PeerItem, PeerLoad

_Slot = tuple[str, WorkerId]

# Upper bounds of the msgpack bytes (gateway/sync/codec.py) that one item, key and load row take,
# beyond the strings they may add to the batch's tables; and of the batch's own fields.
_ITEM_BYTES = 48
_KEY_BYTES = 8
_LOAD_BYTES = 58  # the row, and its entries in "x" and "y"
_USAGE_BYTES = 32  # a quota row, beyond its tenant's name
_HEAD_BYTES = 256 + ENVELOPE_BYTES  # the map's own fields, and the seal's header and tag
_NAME_CHARS = MAX_NAME_BYTES // 4  # names this short together are each within the bound in UTF-8


def item_bytes(item: PeerItem) -> int:
    """An upper bound of what `item` adds to an encoded batch, its table strings included."""
    if isinstance(item, PeerHolding):
        strings = len(item.pool) + len(item.namespace) + len(item.worker)
        return _ITEM_BYTES + _KEY_BYTES * len(item.keys) + strings
    if isinstance(item, PeerCalibration):
        return _ITEM_BYTES + len(item.pool)
    return _ITEM_BYTES


def item_keys(item: PeerItem) -> int:
    return len(item.keys) if isinstance(item, PeerHolding) else 0


def load_bytes(load: PeerLoad) -> int:
    """An upper bound of what `load` adds to an encoded batch, its table strings included."""
    return _LOAD_BYTES + len(load.pool) + len(load.worker)


class SyncPublisher:
    """This gateway's outgoing items and the last in-flight load it published per worker."""

    def __init__(self, origin: str, config: SyncConfig, pools: tuple[int, ...] | None = None) -> None:
        self.origin = origin
        self.config = config
        self.pools = pools  # this gateway's pools' fingerprints, in every batch (`deployment`)
        self._queue: deque[PeerItem] = deque()
        self._queued_at: deque[float] = deque()  # when each queued item came (monotonic), in step
        self.dropped = 0
        self.oversized = 0
        self.batched_items = 0
        self._seq = 0
        self.ready = asyncio.Event()  # set when the queue goes from empty to non-empty
        self._sent_loads: dict[_Slot, LoadCounts] = {}
        self._last_full_s = -float("inf")
        self._prefill_slots = 0  # slots of `_sent_loads` with prefill tokens
        self._usage: deque[tuple[str, Usage]] = deque()  # quota rows still to send, by tenant

    def share_usage(self, rows: Iterable[tuple[str, Usage]]) -> None:
        """Send these tenants' quota figures with the next batches."""
        self._usage.extend(rows)
        if self._usage:
            self.ready.set()

    @property
    def usage_pending(self) -> bool:
        return bool(self._usage)

    def sink(self, item: PeerItem, now_s: float) -> None:
        """The policy's `SyncSink`: queue one item, dropping the oldest when full. Never blocks."""
        queue = self._queue
        if len(queue) >= self.config.queue_max_items:
            queue.popleft()
            self._queued_at.popleft()
            self.dropped += 1
        queue.append(item)
        self._queued_at.append(time.monotonic())
        if len(queue) == 1:
            self.ready.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def prefill_published(self) -> bool:
        """Whether the peers were last told of prefill tokens in flight: until they hear that
        those prefills ended, they count them in front of the worker's queue."""
        return self._prefill_slots > 0

    def full_load_due(self, now_s: float) -> bool:
        return self.full_load_in_s(now_s) <= 0

    def full_load_in_s(self, now_s: float) -> float:
        """Seconds until the next whole load snapshot is due (<= 0: now)."""
        return self._last_full_s + self.config.load_refresh_s - now_s

    def next_batch(
        self, loads: Iterable[PeerLoad], now_s: float, max_bytes: int = 1 << 20
    ) -> SyncBatch | None:
        """The next batch: the in-flight loads that changed since they were last sent (all of
        them when a full snapshot is due), then queued items, at most `batch_max_items` (and
        `PUBLISH_BATCH_ITEMS`) and while the batch stays within `max_bytes` encoded and
        `PUBLISH_BATCH_KEYS` keys. None when there is nothing to send."""
        full = self.full_load_due(now_s)
        out = self._changed_loads(loads, full)
        budget = max_bytes - _HEAD_BYTES - sum(load_bytes(x) for x in out)
        usage: list[tuple[str, Usage]] = []
        pending = self._usage
        while pending and len(usage) < PUBLISH_BATCH_TENANTS:
            tenant = pending[0][0]
            if not name_fits(tenant):
                pending.popleft()  # peers would refuse the whole batch for it
                self.oversized += 1
                continue
            size = _USAGE_BYTES + len(tenant.encode())
            if size > budget:
                break
            budget -= size
            usage.append(pending.popleft())
        queue, queued_at = self._queue, self._queued_at
        items: list[PeerItem] = []
        first_queued_s: float | None = None
        keys_left = PUBLISH_BATCH_KEYS
        max_items = min(self.config.batch_max_items, PUBLISH_BATCH_ITEMS)  # peers refuse many more
        while queue and len(items) < max_items:
            size, keys = item_bytes(queue[0]), item_keys(queue[0])
            if size > max_bytes - _HEAD_BYTES or keys > PUBLISH_BATCH_KEYS or not item_fits(queue[0]):
                queue.popleft()  # would not fit in any batch
                queued_at.popleft()
                self.oversized += 1
                continue
            if size > budget or keys > keys_left:
                break  # the next batch takes it
            budget -= size
            keys_left -= keys
            items.append(queue.popleft())
            at_s = queued_at.popleft()
            if first_queued_s is None:
                first_queued_s = at_s
        if not queue and not pending:
            self.ready.clear()
        if not items and not out and not full and not usage:
            return None
        if full:
            self._last_full_s = now_s
        self._seq += 1
        self.batched_items += len(items)
        # Through a long broker outage an item may wait longer than a batch may say (peers
        # would refuse the batch, its loads with it): at least that long is what it says then.
        waited = (
            0.0 if first_queued_s is None else min(max(0.0, time.monotonic() - first_queued_s), MAX_WAIT_S)
        )
        return SyncBatch(
            self.origin,
            self._seq,
            time.time(),
            full,
            tuple(items),
            tuple(out),
            waited,
            self.pools,
            tuple(usage),
        )

    def _changed_loads(self, loads: Iterable[PeerLoad], full: bool) -> list[PeerLoad]:
        sent = self._sent_loads
        out: list[PeerLoad] = []
        seen: set[_Slot] = set()
        for load in loads:
            if len(load.pool) + len(load.worker) > _NAME_CHARS and not (
                name_fits(load.pool) and name_fits(load.worker)
            ):
                continue  # peers would refuse the whole batch for it
            slot = (load.pool, load.worker)
            seen.add(slot)
            value = load.counts
            if full:
                if not load.idle:
                    out.append(load)
            elif sent.get(slot, NO_LOAD) != value:
                out.append(load)
            if load.idle:
                sent.pop(slot, None)
            else:
                sent[slot] = value
        for slot in [s for s in sent if s not in seen]:
            # A worker that left the registry: its load is gone (a full snapshot says so anyway).
            del sent[slot]
            if not full:
                out.append(PeerLoad(slot[0], slot[1], 0, 0, 0))
        self._prefill_slots = sum(1 for value in sent.values() if value[1] > 0)
        return out
