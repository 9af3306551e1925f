"""The applying half: a peer's batch goes to the policy (holdings, outcomes) and the registry (load).

Batches from this gateway itself are ignored (the broker is also told not to echo them). A batch not
sealed under this deployment's key (`signing`: made up or altered by someone without the key-hash
secret, or of another deployment or release) is counted and dropped before anything of it is read or
any sequence number moves, and logged at most once a minute with its count, never with anything of
its bytes. A batch that does not decode is counted and dropped; so is one at or below its sender's
newest sequence number (a copy or an overtaken batch, which would set the sender's load back:
`sequence`), and a gap in a sender's numbers counts the batches lost on the way. Applying never
raises into the transport: whatever goes wrong, the gateway keeps routing on what it knows.

Only peers count: gateways of the same deployment, that is with a pool in common (same name, same
models: `deployment`). A batch of another deployment publishing on the same subject (the default
subject is the same for every deployment given none) is dropped whole and counted, whatever its
pools are called: its sender is not counted as a gateway (`policies.herd` deals the home shares
over the gateways heard) and nothing of it is applied. Of a peer's batch, what concerns a pool the
peer does not have (one of this gateway's names serving other models) is dropped as an unknown
pool's.

Only the deployment's gateways can seal a batch, but each of them can seal anything (and a
batch can be sent again), so what one batch can cost is bounded here:
holdings and loads of a pool this gateway's registry does not have, and loads of a worker it does
not have, are dropped and counted (they would only be state kept for nothing); holdings of a worker
not discovered yet in a known pool wait, bounded, in `parking.ParkedHoldings` until it is
(discovery may simply have been quicker at the peer); a holding applies at most its first
`MAX_HOLDING_KEYS` keys, and a batch is applied in steps of at most `CHUNK_ITEMS` items and
`CHUNK_KEYS` keys, with requests served in between. A holding or calibration sample of another
block size than its pool's in this gateway's configuration is dropped and counted: its keys cannot
match this gateway's, and the policy would make a pool it has not used yet with the peer's block
size. A batch whose send time is far from this gateway's clock is counted apart from the malformed
ones, and logged at most once a minute per sender: a clock to fix, not a peer. Malformed batches
are logged at most once a minute too, with their count.

A peer's quota rows are charged to this gateway's limiters of the same tenants (`quotas`); a row
of a tenant this gateway does not have, or has without quotas, is dropped and counted. A row
whose batch arrives late (`batch_age.late_s`) charges no more than on time it would still weigh
(`TenantLimiter.peer_usage`: less the later, nothing a bucket's window late), and its requests in
flight count from when they were said, not at all once older than `peer_timeout_s`: a gateway
that just started, or that was away from the broker, may be handed each captured batch of a
sender's last ten minutes in turn (their sequence numbers rise; `sequence`), and on time those
charges would have been refilled long ago. Late rows, and rows a bucket's window late, are counted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from gateway.log_throttle import LogThrottle
from gateway.metrics import GatewayMetrics
from gateway.quotas import TenantLimiter
from gateway.rate_buckets import late_weight
from gateway.registry import Registry
from gateway.sync.batch_age import BatchAges, late_s
from gateway.sync.codec import BadSignature, ClockSkewed, MalformedBatch, SyncBatch, decode
from gateway.sync.deployment import fingerprints
from gateway.sync.parking import ParkedHoldings
from gateway.sync.sequence import SenderSequences
from gateway.sync.signing import BatchKey
from policies.base import RoutingPolicy, WorkerId
from policies.peer_sync import (
    PeerCalibration,
    PeerHolding,
    PeerItem,
    PeerLoads,
    PeerOutcome,
    SupportsPeerSync,
)

log = logging.getLogger("kvgate.sync")

CHUNK_ITEMS = 32
# Keys one step applies (one holding alone may take a step of up to MAX_HOLDING_KEYS): an index
# walk costs a few microseconds a key, so a step stays within tens of milliseconds.
CHUNK_KEYS = 4096
# The longest chain a peer's holding is applied for: 256k tokens at 16-token blocks. Its first
# keys are the prefix any later request shares; the rest comes from KV events or own dispatches.
MAX_HOLDING_KEYS = 16_384
# How long a holding waits for its worker to be discovered here: three of the fleet's 5-second
# discovery rounds (a Kubernetes watch or a DNS refresh is usually far quicker).
PARK_TTL_S = 15.0
# One clock-skew warning per sender in this time, and one of malformed batches, and one of batches
# without a valid signature, whoever sent them (neither names a sender to trust): a peer of another
# wire version or secret, a broken one or a forger sends every batch so.
DROP_LOG_EVERY_S = 60.0


@dataclass(slots=True)
class ApplyStats:
    """What the subscriber did, for the metrics (monotonic counters)."""

    batches: int = 0
    items: int = 0
    bad_signature: int = 0  # not sealed under this deployment's key (`signing`), read no further
    malformed: int = 0  # sealed, but not a batch of this version (a broken peer, or a key holder)
    clock_skew: int = 0  # a batch sent further than `MAX_CLOCK_SKEW_S` from this gateway's clock
    failed: int = 0
    # Holdings and samples of a pool, load rows of a pool or worker, that the registry does not have.
    unknown_worker: int = 0
    truncated: int = 0  # holdings cut to MAX_HOLDING_KEYS
    other_deployment: int = 0  # batches of a sender with none of this gateway's pools (`deployment`)
    block_size: int = 0  # holdings and samples of another block size than their pool's here
    unknown_tenant: int = 0  # quota rows of a tenant this gateway does not have (or has no quotas for)
    late_quota: int = 0  # quota rows of a batch that came late (`batch_age.late_s`): charged in part at most
    stale_quota: int = 0  # quota rows of a batch a bucket's window late or more: charged nothing


class SyncSubscriber:
    """Applies peers' batches to the current policy and folds their load into the registry."""

    def __init__(
        self,
        origin: str,
        registry: Registry,
        peer_timeout_s: float,
        metrics: GatewayMetrics,
        *,
        secret: bytes,
        share_calibration: bool = False,
        limiters: Mapping[str, TenantLimiter] | None = None,
    ) -> None:
        """`limiters`: this gateway's tenants' quota state, charged with what peers charged."""
        self.origin = origin
        self.limiters = limiters or {}
        self.peer_timeout_s = peer_timeout_s
        self._forget_quota_peers_s = -math.inf  # when peers' requests in flight are next expired
        self.share_calibration = share_calibration
        self.registry = registry
        self.key = BatchKey(secret)  # peers' batches are sealed under it (`signing`)
        self._lag = metrics.sync_lag.labels()
        self.loads = PeerLoads(peer_timeout_s)
        self.stats = ApplyStats()
        self.sequences = SenderSequences()
        # This gateway's pools' fingerprints (`deployment`), by pool name, and all of them.
        self._mark_of = fingerprints(
            ((name, pool.config.models) for name, pool in registry.pools.items()), secret
        )
        self._marks = frozenset(self._mark_of.values())
        self.ages = BatchAges()
        self.parked = ParkedHoldings(PARK_TTL_S)
        self.parked_any = asyncio.Event()  # set while something is parked: the service polls for it
        self._seen_workers: dict[str, object] = {}  # pool -> its worker map when last looked at
        self._drops = LogThrottle(log, DROP_LOG_EVERY_S)

    async def on_message(self, data: bytes, policy_of: Callable[[], RoutingPolicy]) -> None:
        """Decode and apply one batch in steps of at most `CHUNK_ITEMS` items and `CHUNK_KEYS`
        keys, with the event loop's other work (requests) in between: a full batch of long chains
        is many index walks."""
        try:
            batch = decode(data, self.key)
        except BadSignature as exc:
            self.stats.bad_signature += 1
            self._drops.warning(
                "signature", time.monotonic(), "sync batch without a valid signature dropped: %s", exc
            )
            return
        except ClockSkewed as exc:
            self.stats.clock_skew += 1
            self._drops.warning(
                ("skew", exc.origin[:128]),
                time.monotonic(),
                "sync batch dropped: the sender's clock and this gateway's are too far apart",
                extra={"peer": exc.origin[:128], "skew_s": round(exc.skew_s, 1)},
            )
            return
        except MalformedBatch as exc:
            self.stats.malformed += 1
            self._drops.warning("malformed", time.monotonic(), "malformed sync batch dropped: %s", exc)
            return
        if not self.accept(batch, time.monotonic()):
            return
        try:
            await self.adopt(policy_of)  # holdings parked for a worker discovered since go first
            now_s = time.monotonic()
            self.note(batch.origin, policy_of(), now_s)
            decided_s = self.decided_s(batch, now_s)
            theirs = _pools_of(batch)
            for k, chunk in enumerate(_chunks(self.known_items(batch.origin, batch.items, now_s, theirs))):
                if k:
                    await asyncio.sleep(0)
                self.apply_items(batch.origin, chunk, policy_of(), time.monotonic(), decided_s=decided_s)
            self.finish(batch, time.monotonic(), theirs)
        except Exception:  # a bug here must not end the subscription
            self.stats.failed += 1
            log.exception("applying a sync batch failed", extra={"peer": batch.origin})

    def apply(self, batch: SyncBatch, policy: RoutingPolicy, now_s: float) -> None:
        """Apply a whole batch at once (what `on_message` does in steps)."""
        if not self.accept(batch, now_s):
            return
        self.note(batch.origin, policy, now_s)
        theirs = _pools_of(batch)
        items = self.known_items(batch.origin, batch.items, now_s, theirs)
        self.apply_items(batch.origin, items, policy, now_s, decided_s=self.decided_s(batch, now_s))
        self.finish(batch, now_s, theirs)

    def accept(self, batch: SyncBatch, now_s: float) -> bool:
        """Whether to apply `batch`: another gateway's, newer than any of its sender's seen yet
        (`sequence`: a copy or an overtaken batch would set its load back), from a gateway of this
        deployment (`deployment`: a pool in common). A sender whose batch says it has none of this
        gateway's pools is not a peer (any more): it is forgotten now, with its load."""
        origin = batch.origin
        if origin == self.origin or not self.sequences.admit(origin, batch.seq, now_s):
            return False
        if batch.pools is None or not self._marks.isdisjoint(batch.pools):  # an earlier release: a peer
            return True
        self.stats.other_deployment += 1
        for pool, worker in self.loads.forget(origin):
            self._refresh(pool, worker)
        return False

    def known(self, pool_name: str, worker_id: WorkerId | None = None) -> bool:
        """Whether this gateway's registry has `pool_name` (and `worker_id` in it)."""
        pool = self.registry.pools.get(pool_name)
        return pool is not None and (worker_id is None or worker_id in pool.workers)

    def block_size_tokens(self, pool_name: str, theirs: frozenset[int] | None = None) -> int | None:
        """The block size of `pool_name` in this gateway's configuration; None when it has no such
        pool, or when the sender's pools `theirs` (None: all of this gateway's) do not include it."""
        pool = self.registry.pools.get(pool_name)
        if pool is None or (theirs is not None and self._mark_of.get(pool_name) not in theirs):
            return None
        return pool.config.block_size_tokens

    def known_items(
        self, origin: str, items: Sequence[PeerItem], now_s: float, theirs: frozenset[int] | None = None
    ) -> list[PeerItem]:
        """`items` less those of pools this gateway does not route to or that the sender's pools
        `theirs` do not include (None: it did not say), and those of another block size than their
        pool's here (all counted), and the holdings of workers it has not discovered (parked) with
        their outcomes, and with every holding cut to its first `MAX_HOLDING_KEYS` keys."""
        kept: list[PeerItem] = []
        parked = self.parked
        stats = self.stats
        for item in items:
            if isinstance(item, PeerHolding):
                if not self._fits(item, theirs):
                    continue
                if len(item.keys) > MAX_HOLDING_KEYS:
                    item = replace(item, keys=item.keys[:MAX_HOLDING_KEYS])
                    stats.truncated += 1
                if not self.known(item.pool, item.worker):
                    parked.park(origin, item, now_s)
                    self.parked_any.set()
                    continue
            elif isinstance(item, PeerOutcome):
                if parked and parked.settle(origin, item.ref, item.served):
                    continue
            elif isinstance(item, PeerCalibration) and not self._fits(item, theirs):
                continue
            kept.append(item)
        return kept

    def _fits(self, item: PeerHolding | PeerCalibration, theirs: frozenset[int] | None) -> bool:
        """Whether `item` is of a pool routed here, shared with the sender, and of its block size
        here; what does not fit is counted."""
        block_size = self.block_size_tokens(item.pool, theirs)
        if block_size is None:
            self.stats.unknown_worker += 1
            return False
        if item.block_size_tokens != block_size:
            self.stats.block_size += 1
            return False
        return True

    @staticmethod
    def note(origin: str, policy: RoutingPolicy, now_s: float) -> None:
        """Tell the policy `origin` was heard from (every batch, load refreshes included)."""
        if isinstance(policy, SupportsPeerSync):
            policy.note_peer(origin, now_s)

    def decided_s(self, batch: SyncBatch, now_s: float) -> float:
        """The earliest the batch's items can have been decided (`batch_age`)."""
        return self.ages.decided_s(batch, now_s, time.time())

    def apply_items(
        self,
        origin: str,
        items: Sequence[PeerItem],
        policy: RoutingPolicy,
        now_s: float,
        *,
        decided_s: float | None = None,
    ) -> None:
        if isinstance(policy, SupportsPeerSync):
            share_calibration = self.share_calibration
            for item in items:
                if share_calibration or not isinstance(item, PeerCalibration):
                    policy.apply_peer(origin, item, now_s, decided_s)
        self.stats.items += len(items)

    def finish(self, batch: SyncBatch, now_s: float, theirs: frozenset[int] | None = None) -> None:
        """The batch's bookkeeping: lag, and its in-flight loads of the pools both gateways have
        (`theirs`, the sender's pools; None: it did not say)."""
        stats = self.stats
        stats.batches += 1
        # Wall clocks: across hosts this includes their skew (same host: the true lag).
        self._lag.observe(max(0.0, time.time() - batch.sent_wall_s))
        mark_of = self._mark_of
        loads = [
            x
            for x in batch.loads
            if self.known(x.pool, x.worker) and (theirs is None or mark_of.get(x.pool) in theirs)
        ]
        stats.unknown_worker += len(batch.loads) - len(loads)
        for pool, worker in self.loads.note(batch.origin, loads, now_s, full=batch.full_load):
            self._refresh(pool, worker)
        if batch.usage:
            self._charge(batch, now_s)

    def _charge(self, batch: SyncBatch, now_s: float) -> None:
        """Charge the batch's quota rows to this gateway's limiters as late as the batch came (no
        more than on time they would still weigh); requests in flight said longer than
        `peer_timeout_s` ago are not counted (nor those the sender said before, older still)."""
        stats = self.stats
        late = late_s(batch, time.time())
        charged = late_weight(late) > 0.0
        stale_in_flight = late >= self.peer_timeout_s
        limiters = self.limiters
        for tenant, usage in batch.usage:
            limiter = limiters.get(tenant)
            if limiter is None:
                stats.unknown_tenant += 1
                continue
            if late > 0.0 and charged:
                stats.late_quota += 1
            elif late > 0.0:
                stats.stale_quota += 1
            if stale_in_flight and usage.in_flight:
                usage = replace(usage, in_flight=0)
            limiter.peer_usage(batch.origin, usage, now_s, late)

    async def adopt(self, policy_of: Callable[[], RoutingPolicy]) -> None:
        """Apply the parked holdings (and the served outcomes kept with them) of the workers
        discovered since they were parked, in steps as a batch is. Costs one look at each pool's
        worker map unless discovery replaced one (`Pool.set_urls`) since the last look."""
        if not self.parked or not self._workers_changed():
            return
        taken = self.parked.take(self.known)
        if not self.parked:
            self.parked_any.clear()
        items, keys = 0, 0
        for parked in taken:
            if items >= CHUNK_ITEMS or keys >= CHUNK_KEYS:
                await asyncio.sleep(0)
                items, keys = 0, 0
            batch: list[PeerItem] = [parked.holding]
            if parked.served:
                batch.append(PeerOutcome(parked.holding.ref, True))
            self.apply_items(parked.origin, batch, policy_of(), time.monotonic())
            items, keys = items + len(batch), keys + len(parked.holding.keys)

    def _workers_changed(self) -> bool:
        """Whether any pool's worker map was replaced since the last call (discovery replaces the
        map on every change, and keeps it otherwise)."""
        changed = False
        seen = self._seen_workers
        for name, pool in self.registry.pools.items():
            if seen.get(name) is not pool.workers:
                seen[name] = pool.workers
                changed = True
        return changed

    def expire(self, now_s: float) -> None:
        """Forget peers not heard from within the timeout (and their load), and holdings parked
        for longer than their TTL."""
        self.parked.expire(now_s)
        if not self.parked:
            self.parked_any.clear()
        for pool, worker in self.loads.expire(now_s):
            self._refresh(pool, worker)
        self.sequences.expire(now_s)
        self.ages.keep(self.loads.heard_from)
        if now_s >= self._forget_quota_peers_s:  # at most once a second, whatever the tenants
            self._forget_quota_peers_s = now_s + 1.0
            for limiter in self.limiters.values():
                if limiter.has_peers:
                    limiter.forget_peers(now_s - self.peer_timeout_s)

    def _refresh(self, pool_name: str, worker_id: WorkerId) -> None:
        pool = self.registry.pools.get(pool_name)
        worker = None if pool is None else pool.workers.get(worker_id)
        if worker is not None:
            worker.note_peer_load(self.loads.total(pool_name, worker_id))


def _chunks(items: Sequence[PeerItem]) -> Iterator[Sequence[PeerItem]]:
    """`items` in steps of at most `CHUNK_ITEMS` items and `CHUNK_KEYS` keys (a longer holding is
    a step of its own)."""
    start, keys = 0, 0
    for end, item in enumerate(items):
        n = len(item.keys) if isinstance(item, PeerHolding) else 0
        if end > start and (end - start >= CHUNK_ITEMS or keys + n > CHUNK_KEYS):
            yield items[start:end]
            start, keys = end, 0
        keys += n
    if start < len(items):
        yield items[start:]


def _pools_of(batch: SyncBatch) -> frozenset[int] | None:
    return None if batch.pools is None else frozenset(batch.pools)
