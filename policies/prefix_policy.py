"""Plumbing shared by the prefix-aware policies: pools, tenants, feedback and KV events."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.base import Isolation, KvEvent, Observation, RouteDecision, RouteRequest, WorkerId
from policies.index import NO_MATCH, PrefixMatch
from policies.kv_feed import KvEventFeed, TokenBlockHasher
from policies.pools import PoolSet, PoolSettings, PoolState
from policies.stats import DecisionCounter, PolicyStats
from policies.tenants import PromotionConfig, PublicPrefixes, TenantSettings, effective_isolation
from prompt_normalizer.types import PUBLIC_NAMESPACE


@dataclass(frozen=True, slots=True)
class SharedSettings:
    """Settings every prefix-aware policy takes: pools, tenants, promotion, precise mode."""

    pools: Mapping[str, PoolSettings] = field(default_factory=dict)
    default_pool: PoolSettings = field(default_factory=PoolSettings)
    tenants: Mapping[str, TenantSettings] = field(default_factory=dict)
    default_index_share: float | None = None
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    precise_namespace: str = PUBLIC_NAMESPACE


@dataclass(frozen=True, slots=True)
class Lookup:
    """One request's view of the index: own-namespace match, public match, and their union."""

    own: PrefixMatch
    public: PrefixMatch
    public_blocks: int

    def blocks(self, worker: WorkerId) -> int:
        return max(self.own.blocks(worker), self.public.blocks(worker))

    @property
    def longest_blocks(self) -> int:
        return max(self.own.longest_blocks, self.public.longest_blocks)


class PrefixPolicyBase:
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
            self._ns_share[req.namespace] = settings.index_share

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

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
        """Own namespace always (`own`, when the caller already looked it up); the public namespace
        too when the immutable chain is public and the tenant's isolation allows sharing."""
        isolation = effective_isolation(req, self.shared.tenants)
        n_pub = self._public.observe(req, isolation, now_s) if observe else 0
        if own is None:
            own = pool.index.lookup(req.block_keys, req.namespace, now_s)
        public = NO_MATCH
        if n_pub and req.namespace != PUBLIC_NAMESPACE:
            public = pool.index.lookup(req.public_block_keys[:n_pub], PUBLIC_NAMESPACE, now_s)
        return Lookup(own, public, n_pub if isolation is not Isolation.STRICT else 0)

    def _cap_tokens(self, req: RouteRequest, blocks: int) -> int:
        # vLLM never serves the last prompt token from cache (max hit = prompt − 1, full blocks).
        bs = req.block_size_tokens
        limit = ((req.n_prompt_tokens - 1) // bs) * bs if req.n_prompt_tokens > 0 else 0
        return max(0, min(blocks * bs, limit))

    def _record(self, req: RouteRequest, decision: RouteDecision, now_s: float, *, speculative: bool) -> None:
        pool = self._pool(req)
        pool.index.record(req.block_keys, decision.worker, req.namespace, now_s, speculative=speculative)
        n_pub = decision.shared_prefix_blocks
        if n_pub and req.namespace != PUBLIC_NAMESPACE:
            public_keys = req.public_block_keys[:n_pub]
            pool.index.record(public_keys, decision.worker, PUBLIC_NAMESPACE, now_s, speculative=speculative)

    # -- the Protocol's feedback hooks ----------------------------------------------------------

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        self._record(req, decision, now_s, speculative=True)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        pool = self._pool(obs.request)
        req = obs.request
        if obs.failed:
            # Only a served request says what the worker caches: take back this request's unconfirmed
            # holdings on that worker, and its calibration record.
            self._count("failed_observations")
            pool.index.drop_speculative(req.block_keys, obs.worker, req.namespace)
            if req.public_block_keys and req.namespace != PUBLIC_NAMESPACE:
                pool.index.drop_speculative(req.public_block_keys, obs.worker, PUBLIC_NAMESPACE)
            pool.cost.forget(req.request_id)
            return
        n_pub = PublicPrefixes.public_blocks(req)
        isolation = effective_isolation(req, self.shared.tenants)
        if n_pub and (
            isolation is Isolation.STRICT or not self._public.is_public(req.public_block_keys[n_pub - 1])
        ):
            n_pub = 0
        decision = RouteDecision(obs.worker, 0.0, "feedback", shared_prefix_blocks=n_pub)
        # The worker computed the whole prompt, so it now holds every full block of it.
        self._record(obs.request, decision, now_s, speculative=False)
        pool.cost.note_complete(
            req.request_id, obs.ttft_s, obs.prompt_tokens, obs.cached_tokens, req.n_prompt_tokens
        )

    def set_token_hasher(self, hasher: TokenBlockHasher) -> None:
        """Enable precise mode: KV events are keyed with `hasher` (the normalizer's token-chain hash)."""
        self._hasher = hasher
        self._feeds.clear()

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

    # -- stats --------------------------------------------------------------------------------

    def stats(self) -> PolicyStats:
        counters = dict(self._counters)
        counters["public_promotions"] = self._public.promotions
        counters["public_demotions"] = self._public.demotions
        counters["public_prefixes"] = self._public.promoted_count()
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
