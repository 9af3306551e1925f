"""Plumbing shared by the prefix-aware policies: pools, tenants, feedback and KV events (replica
sync: `policies.prefix_sync`)."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from policies.base import Isolation, KvEvent, Observation, RouteDecision, RouteRequest, WorkerId
from policies.cost_model import CostModel
from policies.index import NO_MATCH, PrefixMatch
from policies.kv_feed import KvEventFeed, TokenBlockHasher
from policies.pools import PoolSet, PoolSettings, PoolState
from policies.prefix_sync import PeerSyncing
from policies.records import record
from policies.request_keys import Lookup, OwnKeys, tenant_scoped
from policies.stats import DecisionCounter, PolicyStats
from policies.tenants import (
    PromotionConfig,
    PublicPrefixes,
    TenantSettings,
    effective_isolation,
    wholly_public_blocks,
)
from prompt_normalizer.types import PUBLIC_NAMESPACE


def servable_tokens(n_prompt: int, block_size: int) -> int:
    """The most of an `n_prompt`-token prompt a worker can serve from cache: whole blocks, never
    the last token (vLLM computes it to produce the first output token)."""
    return ((n_prompt - 1) // block_size) * block_size if n_prompt > 0 else 0


@dataclass(frozen=True, slots=True)
class SharedSettings:
    """Settings every prefix-aware policy takes: pools, tenants, promotion, precise mode."""

    pools: Mapping[str, PoolSettings] = field(default_factory=dict)
    default_pool: PoolSettings = field(default_factory=PoolSettings)
    tenants: Mapping[str, TenantSettings] = field(default_factory=dict)
    default_index_share: float | None = None
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    precise_namespace: str = PUBLIC_NAMESPACE


@record
class _Dispatched:
    shared: int  # public blocks the request was dispatched with (0: its tenant's salt)
    pending: bool  # its dispatch left speculative holdings that its completion confirms


class PrefixPolicyBase(PeerSyncing):
    """Pools, tenant namespaces, feedback and KV events; subclasses implement `select`."""

    def __init__(self, *, seed: int = 0, shared: SharedSettings | None = None) -> None:
        self.shared = shared or SharedSettings()
        self._rng = random.Random(seed)
        self._ns_share: dict[str, float] = {}
        self._pools = PoolSet(self.shared.pools, self.shared.default_pool, self._namespace_share)
        self._public = PublicPrefixes(self.shared.promotion)
        self._decisions = DecisionCounter()
        self._counters: dict[str, int] = {}
        self._feeds: dict[str, KvEventFeed] = {}
        self._hasher: TokenBlockHasher | None = None
        # The last request's `OwnKeys` (select and dispatch ask for the same request in turn).
        self._own_memo: tuple[RouteRequest, OwnKeys] | None = None
        # (request id, worker) -> what it was dispatched with there: its public blocks (what its
        # worker KV is salted by) and whether that dispatch left speculative holdings for its
        # completion to confirm. By worker too: SGLang's two legs of one request run at once.
        self._dispatched: dict[tuple[str, WorkerId], _Dispatched] = {}
        self._init_peer_sync()
        # The pools whose KV-event feeds a reload took over (`carry_over`): kept by the next
        # `set_token_hasher`, which gives the same keys for them.
        self._carried_feeds: frozenset[str] = frozenset()

    MAX_DISPATCHED = 65_536

    def retire(self) -> None:
        """`CarriesLearning.retire`: each learned structure is replaced by an empty one, never
        emptied in place (the policy that took over may hold the very same objects)."""
        self._pools = PoolSet(self.shared.pools, self.shared.default_pool, self._namespace_share)
        self._public = PublicPrefixes(self.shared.promotion)
        self._feeds = {}
        self._dispatched = {}
        self._own_memo = None
        self._carried_feeds = frozenset()
        self._init_peer_sync()

    def carry_over(self, previous: object, pools: Collection[str]) -> list[str]:
        """A policy reload's hand-over (`policies.pools.CarriesLearning`): take over what
        `previous`, the prefix-aware policy this one replaces, learned. Of each pool in `pools`
        (its prompts keyed as before) whose index is sized as before: the index, with every
        worker's holdings, and the calibrated cost model when the cost constants are the same
        (`PoolSet.carry`), and in precise mode its KV-event feeds. Of the whole: the salts its running
        requests were dispatched with (their completions confirm what they computed), the
        namespaces' index shares, the promoted public prefixes when promotion is set as before,
        and the replica-sync bookkeeping (`PeerSyncing.carry_peer_sync`). What only a subclass
        keeps it takes over itself (`CostPolicy.carry_over`); the counters start afresh.
        Nothing is taken from a policy of another kind: returns the pools taken over."""
        if not isinstance(previous, PrefixPolicyBase):
            return []
        kept = self._pools.carry(previous._pools, pools)
        dispatched = self._dispatched
        dispatched.update(previous._dispatched)
        while len(dispatched) > self.MAX_DISPATCHED:
            dispatched.pop(next(iter(dispatched)))
        if self.shared.promotion == previous.shared.promotion:
            self._public = previous._public
        # Namespaces keep their index shares until their tenant's next request notes the new ones
        # (without them, a holding recorded before that trims a tenant to the default share).
        self._ns_share.update(previous._ns_share)
        # Precise mode: each worker's map from engine hashes to our keys goes with the index (the
        # pool's normalizer, so its hasher's keys, did not change); without it the workers' later
        # events (removals, chains extended) would match nothing in the index taken over.
        for name in kept:
            feed = previous._feeds.get(name)
            if feed is not None:
                self._feeds[name] = feed
        self._hasher = previous._hasher
        self._carried_feeds = frozenset(self._feeds)
        self.carry_peer_sync(previous)
        return kept

    # -- helpers for subclasses ---------------------------------------------------------------

    def _namespace_share(self, namespace: str) -> float:
        share = self._ns_share.get(namespace)
        if share is not None:
            return share
        if self.shared.default_index_share is not None:
            return self.shared.default_index_share
        return self.shared.default_pool.index.namespace_share

    def _note_tenant(self, req: RouteRequest) -> None:
        settings = self.shared.tenants.get(req.tenant)
        if settings is not None and settings.index_share is not None:
            if len(self._ns_share) > 65_536:
                self._ns_share.clear()
            self._ns_share[self._own_keys(req).namespace] = settings.index_share

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _own_keys(self, req: RouteRequest) -> OwnKeys:
        """Where the KV a request computes under its tenant's salt is indexed.

        A `public` tenant's request keyed in the public namespace still carries its tenant's salt
        unless it is wholly public, so its keys are re-scoped to the tenant: another tenant's
        public-namespace chain must not look like a hit the worker cannot serve. Any other request
        keyed in the public namespace is unsalted (one trust domain) and keeps its keys.
        """
        memo = self._own_memo
        if memo is not None and memo[0] is req:
            return memo[1]
        if req.namespace != PUBLIC_NAMESPACE or req.isolation is not Isolation.PUBLIC:
            own = OwnKeys(req.block_keys, req.namespace)
        else:
            own = OwnKeys(tenant_scoped(req.block_keys, req.tenant), f"{PUBLIC_NAMESPACE}/{req.tenant}")
        self._own_memo = (req, own)
        return own

    def _shared_blocks(self, req: RouteRequest, n_public: int) -> int:
        """`n_public` if the gateway will give `req` the public salt for it, else 0."""
        return wholly_public_blocks(req, effective_isolation(req, self.shared.tenants), n_public)

    def _pool(self, req: RouteRequest) -> PoolState:
        return self._pools.get(req.pool, req.block_size_tokens)

    def _lookup(
        self,
        pool: PoolState,
        req: RouteRequest,
        now_s: float,
        *,
        observe: bool = True,
        own: PrefixMatch | None = None,
    ) -> Lookup:
        """The public namespace when the request is wholly inside a promoted public prefix (it will
        carry the public salt), else its own keys (`own`, when the caller already looked them up)."""
        if not req.public_block_keys and own is not None:
            # A strict tenant's request: nothing public to count or use.
            self._public.tick(now_s)
            return Lookup(own, NO_MATCH, 0)
        isolation = effective_isolation(req, self.shared.tenants)
        n_pub = self._public.observe(req, isolation, now_s) if observe else 0
        shared = wholly_public_blocks(req, isolation, n_pub)
        if shared:
            public = pool.index.lookup(req.public_block_keys[:shared], PUBLIC_NAMESPACE, now_s)
            return Lookup(NO_MATCH, public, shared)
        if own is None:
            mine = self._own_keys(req)
            own = pool.index.lookup(mine.keys, mine.namespace, now_s)
        return Lookup(own, NO_MATCH, 0)

    def _cap_tokens(self, req: RouteRequest, blocks: int) -> int:
        bs = req.block_size_tokens
        return max(0, min(blocks * bs, servable_tokens(req.n_prompt_tokens, bs)))

    def _record(
        self,
        pool: PoolState,
        req: RouteRequest,
        worker: WorkerId,
        shared: int,
        now_s: float,
        *,
        speculative: bool,
    ) -> int:
        """Record the worker's new holdings in `pool` (the request's) under the salt it computes
        them with: the public chain when `shared` > 0 (wholly public), else the request's own keys.
        Returns how many of them are still speculative."""
        if shared:
            keys = req.public_block_keys[:shared]
            return pool.index.record(keys, worker, PUBLIC_NAMESPACE, now_s, speculative=speculative)
        mine = self._own_keys(req)
        return pool.index.record(mine.keys, worker, mine.namespace, now_s, speculative=speculative)

    # -- what prefill/decode routing asks (policies/pd.py) ----------------------------------------

    def held_tokens(self, req: RouteRequest, shared_prefix_blocks: int, now_s: float) -> dict[WorkerId, int]:
        """Prompt tokens each worker holds for `req` (cacheable ones, per the index), under the salt
        the request carries: the public chain when it is routed as wholly public, else its own."""
        pool = self._pool(req)
        if shared_prefix_blocks:
            keys = req.public_block_keys[:shared_prefix_blocks]
            match = pool.index.lookup(keys, PUBLIC_NAMESPACE, now_s)
        else:
            mine = self._own_keys(req)
            match = pool.index.lookup(mine.keys, mine.namespace, now_s)
        return {w: self._cap_tokens(req, blocks) for w, blocks in match.blocks_by_worker.items()}

    def cost_model(self, req: RouteRequest) -> CostModel:
        """The cost model (calibrated online) of the request's pool."""
        return self._pool(req).cost

    # -- the Protocol's feedback hooks ----------------------------------------------------------

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        # The gateway applies the same rule to `shared_prefix_blocks`, so this is the salt it sets.
        shared = (
            self._shared_blocks(req, decision.shared_prefix_blocks) if decision.shared_prefix_blocks else 0
        )
        dispatched = self._dispatched
        key = (req.request_id, decision.worker)
        if len(dispatched) >= self.MAX_DISPATCHED and key not in dispatched:
            dispatched.pop(next(iter(dispatched)))  # bounded: the oldest falls back to the rule below
        pool = self._pools.get(req.pool, req.block_size_tokens)  # `_pool`, inlined
        pending = self._record(pool, req, decision.worker, shared, now_s, speculative=True)
        dispatched[key] = _Dispatched(shared, pending > 0)
        if self._sync_sink is not None:
            self._unseen.own(now_s)
            self._publish_dispatch(pool, req, decision, shared, now_s, pending)
        self._dispatched_to(pool, req, decision, now_s)

    def _dispatched_to(
        self, pool: PoolState, req: RouteRequest, decision: RouteDecision, now_s: float
    ) -> None:
        """What a subclass keeps of each dispatch, once the index has it (`pool`: the request's)."""

    def on_complete(self, obs: Observation, now_s: float) -> None:
        req = obs.request
        pool = self._pools.get(req.pool, req.block_size_tokens)  # `_pool`, inlined
        if self._sync_sink is not None:
            self._publish_outcome(req, not obs.failed, now_s)
        if obs.failed:
            # Only a served request says what the worker caches: take back this request's unconfirmed
            # holdings on that worker, and its calibration record.
            self._count("failed_observations")
            self._dispatched.pop((req.request_id, obs.worker), None)
            mine = self._own_keys(req)
            pool.index.drop_speculative(mine.keys, obs.worker, mine.namespace)
            if req.public_block_keys:
                pool.index.drop_speculative(req.public_block_keys, obs.worker, PUBLIC_NAMESPACE)
            pool.cost.forget(req.request_id, obs.worker)
            return
        dispatched = self._dispatched.pop((req.request_id, obs.worker), None)
        if dispatched is None:
            # Not dispatched through this policy (or forgotten): the salt follows the current state.
            n_pub = PublicPrefixes.public_blocks(req)
            if n_pub and not self._public.is_public(req.public_block_keys[n_pub - 1]):
                n_pub = 0
            shared = self._shared_blocks(req, n_pub)
            self._record(pool, req, obs.worker, shared, now_s, speculative=False)
        elif dispatched.pending:
            # The worker computed the whole prompt under the salt it was dispatched with (a chain
            # promoted while the request ran does not change its KV), so it holds every full block.
            # A dispatch that found every block already confirmed left nothing to confirm.
            if dispatched.shared:
                keys = req.public_block_keys[: dispatched.shared]
                pool.index.confirm(keys, obs.worker, PUBLIC_NAMESPACE, now_s)
            else:
                mine = self._own_keys(req)
                pool.index.confirm(mine.keys, obs.worker, mine.namespace, now_s)
        sample = pool.cost.note_complete(
            req.request_id, obs.worker, obs.ttft_s, obs.prompt_tokens, obs.cached_tokens, req.n_prompt_tokens
        )
        if sample is not None and self._sync_sink is not None and self._sync_calibration:
            self._publish_calibration(req, sample, now_s)

    def set_token_hasher(self, hasher: TokenBlockHasher) -> None:
        """Enable precise mode: KV events are keyed with `hasher` (the normalizer's token-chain
        hash). The feeds a reload took over are kept (their pools' keys are the same); any other
        is built afresh with it."""
        self._hasher = hasher
        carried, self._carried_feeds = self._carried_feeds, frozenset()
        for name in [name for name in self._feeds if name not in carried]:
            del self._feeds[name]

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        pool = self._pools.pool_of(worker)
        if pool is None or self._hasher is None:
            self._count("kv_events_ignored")
            return
        feed = self._feeds.get(pool.name)
        if feed is None or feed.index is not pool.index:
            feed = KvEventFeed(pool.index, self._hasher, self.shared.precise_namespace)
            self._feeds[pool.name] = feed
        feed.apply(worker, event, now_s)
        self._count("kv_events_applied")

    # -- the workers' comings and goings (`policies.pools.FollowsWorkers`) ----------------------

    def worker_joined(self, pool: str, worker: WorkerId) -> None:
        self._worker_changed(pool, worker, PoolState.worker_joined, new_process=True, gone=False)

    def worker_left(self, pool: str, worker: WorkerId) -> None:
        self._worker_changed(pool, worker, PoolState.worker_left, new_process=True, gone=True)

    def worker_reset(self, pool: str, worker: WorkerId) -> None:
        self._worker_changed(pool, worker, PoolState.worker_reset, new_process=False, gone=False)

    def _worker_changed(
        self,
        pool: str,
        worker: WorkerId,
        change: Callable[[PoolState, WorkerId], None],
        *,
        new_process: bool,
        gone: bool,
    ) -> None:
        state = self._pools.existing(pool)
        if state is not None:
            change(state, worker)
        feed = self._feeds.get(pool)
        if new_process and feed is not None:
            feed.forget_worker(worker)  # kept on a reset: see `policies.kv_feed`
        self._forget_load(pool, worker, gone)

    def _forget_load(self, pool: str, worker: WorkerId, gone: bool) -> None:
        """Drop what the policy keeps of the work it sent `worker` of `pool`: it left (`gone`),
        or it joined or may have restarted; nothing here."""

    # -- stats --------------------------------------------------------------------------------

    def stats(self) -> PolicyStats:
        counters = dict(self._counters)
        counters["public_promotions"] = self._public.promotions
        counters["public_demotions"] = self._public.demotions
        counters["public_prefixes"] = self._public.promoted_count()
        counters.update(self._peers.counters)
        for name, feed in self._feeds.items():
            counters[f"kv_event_orphans:{name}"] = feed.orphans
            counters[f"kv_event_mismatched:{name}"] = feed.mismatched
            counters[f"kv_event_bad_tokens:{name}"] = feed.bad_tokens
        return PolicyStats(
            policy=getattr(self, "name", type(self).__name__),
            decisions_by_reason=self._decisions.snapshot(),
            counters=counters,
            index={name: pool.index.stats() for name, pool in self._pools.items()},
        )

    def drain_promotion_events(self) -> list[str]:
        """Promotion/demotion lines the gateway may log: keyed hashes and reasons only."""
        lines = [f"{e.kind} chain={e.chain_key_hex} reason={e.reason}" for e in self._public.events]
        self._public.events.clear()
        return lines

    def check_invariants(self) -> None:
        for _name, pool in self._pools.items():
            pool.index.check_invariants()
