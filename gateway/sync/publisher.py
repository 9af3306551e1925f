"""The publishing half: the policy's sink feeds a bounded queue, batches are cut from it.

`sink` runs inside a request's dispatch, so it only appends to a deque: when the queue is full the
oldest item is dropped and counted (a peer then misses one holding, which its TTL or a later
dispatch of the same chain makes up for). Nothing here awaits; the service's task sends the
batches, so a slow or absent broker never holds a request.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from gateway.config import SyncConfig
from gateway.sync.codec import SyncBatch
from policies.base import WorkerId
from policies.peer_sync import PeerItem, PeerLoad

_Slot = tuple[str, WorkerId]


class SyncPublisher:
    """This gateway's outgoing items and the last in-flight load it published per worker."""

    def __init__(self, origin: str, config: SyncConfig) -> None:
        self.origin = origin
        self.config = config
        self._queue: deque[PeerItem] = deque()
        self.dropped = 0
        self.batched_items = 0
        self._seq = 0
        self.ready = asyncio.Event()  # set when the queue goes from empty to non-empty
        self._sent_loads: dict[_Slot, tuple[int, int, int]] = {}
        self._last_full_s = -float("inf")

    def sink(self, item: PeerItem, now_s: float) -> None:
        """The policy's `SyncSink`: queue one item, dropping the oldest when full. Never blocks."""
        queue = self._queue
        if len(queue) >= self.config.queue_max_items:
            queue.popleft()
            self.dropped += 1
        queue.append(item)
        if len(queue) == 1:
            self.ready.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def full_load_due(self, now_s: float) -> bool:
        return self.full_load_in_s(now_s) <= 0

    def full_load_in_s(self, now_s: float) -> float:
        """Seconds until the next whole load snapshot is due (<= 0: now)."""
        return self._last_full_s + self.config.load_refresh_s - now_s

    def next_batch(self, loads: Iterable[PeerLoad], now_s: float) -> SyncBatch | None:
        """The next batch: up to `batch_max_items` queued items, plus the in-flight loads that
        changed since they were last sent (all of them when a full snapshot is due). None when
        there is nothing to send."""
        queue = self._queue
        n = min(len(queue), self.config.batch_max_items)
        items = tuple(queue.popleft() for _ in range(n))
        if not queue:
            self.ready.clear()
        full = self.full_load_due(now_s)
        sent = self._sent_loads
        out: list[PeerLoad] = []
        seen: set[_Slot] = set()
        for load in loads:
            slot = (load.pool, load.worker)
            seen.add(slot)
            value = (load.requests, load.prefill_tokens, load.decode_tokens)
            if full:
                if not load.idle:
                    out.append(load)
            elif sent.get(slot, (0, 0, 0)) != value:
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
        if not items and not out and not full:
            return None
        if full:
            self._last_full_s = now_s
        self._seq += 1
        self.batched_items += n
        return SyncBatch(self.origin, self._seq, time.time(), full, items, tuple(out))
