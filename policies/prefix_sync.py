"""A prefix policy's side of replica sync (`policies.peer_sync`): what it publishes of its own
dispatches and completions, and how it applies its peers'.

`PrefixPolicyBase` takes it as a base class; the subclasses read its state (`_sync_sink`,
`_unseen`, `_gateways`: `policies.cost_herd`) and may extend `_apply_peer_holding`.
"""

from __future__ import annotations

from policies.base import RouteDecision, RouteRequest
from policies.cost_model import CalibrationSample
from policies.herd import Gateways, UnseenPeers
from policies.peer_sync import PeerCalibration, PeerHolding, PeerItem, PeerOutcome, PeerRouting, SyncSink
from policies.pools import PoolSet, PoolState
from policies.request_keys import OwnKeys
from prompt_normalizer.types import PUBLIC_NAMESPACE


class PeerSyncing:
    """Replica sync for a prefix policy: off until a sink is set (`set_sync_sink`)."""

    _pools: PoolSet

    def _own_keys(self, req: RouteRequest) -> OwnKeys:
        raise NotImplementedError  # the policy's (`PrefixPolicyBase._own_keys`)

    def _init_peer_sync(self) -> None:
        self._sync_sink: SyncSink | None = None
        self._sync_calibration = False
        self._peers = PeerRouting()
        # Same-instant decisions across synced gateways (`policies.herd`): what this gateway's
        # decisions cannot see of its peers', and the gateways there are.
        self._unseen = UnseenPeers()
        self._gateways = Gateways("")

    def carry_peer_sync(self, previous: PeerSyncing) -> None:
        """Take over `previous`'s sync bookkeeping on a policy reload: its running dispatches'
        refs (their outcomes name them to the peers, and the refs go on from there rather than
        start again at 1, which peers would take for the old ones), the peers' holdings awaiting
        their outcomes (held in the index taken over) and what it saw of its peers' decisions.
        The sink is set again on the new policy by the gateway (`set_sync_sink`)."""
        self._peers = previous._peers
        self._unseen = previous._unseen
        self._gateways = previous._gateways

    def set_sync_sink(self, sink: SyncSink | None, *, calibration: bool = False, origin: str = "") -> None:
        """Publish every dispatch and outcome to `sink` from now on (None: stop), and with
        `calibration` every completion's calibration sample too; `origin` is this gateway's name on
        the bus (`policies.herd.home_workers` deals workers by it)."""
        self._sync_sink = sink
        self._sync_calibration = calibration
        if origin != self._gateways.name:
            self._gateways = Gateways(origin)

    def _publish_dispatch(
        self,
        pool: PoolState,
        req: RouteRequest,
        decision: RouteDecision,
        shared: int,
        now_s: float,
        pending: int,
    ) -> None:
        sink = self._sync_sink
        assert sink is not None
        if shared:
            keys, namespace = req.public_block_keys[:shared], PUBLIC_NAMESPACE
        else:
            mine = self._own_keys(req)
            keys, namespace = mine.keys, mine.namespace
        g = pool.index.config.granularity_blocks
        if len(keys) < g:
            return
        if not pending and pool.index.last_use_s(keys[g - 1], decision.worker) != now_s:
            # The dispatch left the chain as it was: confirmed here and touched within the index's
            # recency resolution, by a dispatch or an outcome the peers were told of then.
            return
        ref = self._peers.dispatched(req.request_id)
        holding = PeerHolding(
            ref, req.pool, req.block_size_tokens, namespace, keys, decision.worker,
            req.n_prompt_tokens, decision.matched_tokens,
        )  # fmt: skip
        sink(holding, now_s)

    def _publish_outcome(self, req: RouteRequest, served: bool, now_s: float) -> None:
        """Tell the peers how a request this gateway dispatched (and published) ended."""
        assert self._sync_sink is not None
        ref = self._peers.finished(req.request_id)
        if ref is not None:
            self._sync_sink(PeerOutcome(ref, served), now_s)

    def _publish_calibration(self, req: RouteRequest, sample: CalibrationSample, now_s: float) -> None:
        assert self._sync_sink is not None
        self._sync_sink(
            PeerCalibration(
                req.pool, req.block_size_tokens, sample.prompt_tokens, sample.request_tokens,
                sample.scale_ratio,
            ),
            now_s,
        )  # fmt: skip

    def hold_s(self, req: RouteRequest, now_s: float) -> float:
        """Seconds the gateway should hold `req` before deciding it, so that its peers' decisions
        of the same instant reach this one first (`policies.cost_policy`, step 5); 0 here."""
        return 0.0

    def note_peer(self, origin: str, now_s: float) -> None:
        """Gateway `origin` was heard from: it counts in the deal of home shares (`policies.herd`)."""
        self._gateways.heard(origin, now_s)

    @property
    def unseen_peer_dispatches(self) -> float:
        """Peer dispatches one of this policy's decisions could not see yet, on average
        (`policies.herd.UnseenPeers`)."""
        return self._unseen.per_decision

    def apply_peer(self, origin: str, item: PeerItem, now_s: float, decided_s: float | None = None) -> None:
        """Apply what gateway `origin` published: a holding is recorded as speculative, as a local
        dispatch is; an outcome confirms it (served) or takes its unconfirmed blocks back.
        `decided_s`: the earliest the origin can have decided it, on this gateway's clock (None:
        unknown); with it a holding also counts toward `policies.herd.UnseenPeers`."""
        peers = self._peers
        if isinstance(item, PeerCalibration):
            self._apply_peer_calibration(item)
            return
        if isinstance(item, PeerHolding):
            pool = self._pools.existing(item.pool)
            if pool is None:
                pool = self._pools.get(item.pool, item.block_size_tokens)
            elif pool.block_size_tokens != item.block_size_tokens:
                peers.count("peer_block_size_mismatch")  # a peer on another config: keep ours
                return
            self._apply_peer_holding(pool, item, now_s)
            peers.remember(origin, item)
            self._gateways.heard(origin, now_s)
            if decided_s is not None:
                self._unseen.peer(decided_s, now_s)
            peers.count("peer_holdings_applied")
            return
        held = peers.settle(origin, item.ref)
        pool = None if held is None else self._pools.existing(held.pool)
        if held is None or pool is None or pool.block_size_tokens != held.block_size_tokens:
            peers.count("peer_outcomes_unmatched")
            return
        if item.served:
            pool.index.confirm(held.keys, held.worker, held.namespace, now_s)
        else:
            pool.index.drop_speculative(held.keys, held.worker, held.namespace)
        peers.count("peer_outcomes_applied")

    def _apply_peer_holding(self, pool: PoolState, holding: PeerHolding, now_s: float) -> None:
        pool.index.record(holding.keys, holding.worker, holding.namespace, now_s, speculative=True)

    def _apply_peer_calibration(self, item: PeerCalibration) -> None:
        """Fold a peer's completion into this gateway's cost model of the same pool, as if it had
        seen it: N gateways then calibrate from all completions, and score alike."""
        pool = self._pools.existing(item.pool)
        if pool is None:
            pool = self._pools.get(item.pool, item.block_size_tokens)
        elif pool.block_size_tokens != item.block_size_tokens:
            self._peers.count("peer_block_size_mismatch")  # a peer on another config: keep ours
            return
        pool.cost.fold(CalibrationSample(item.prompt_tokens, item.request_tokens, item.scale_ratio))
        self._peers.count("peer_calibration_applied")
