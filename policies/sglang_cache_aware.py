"""`sglang_cache_aware`: sglang-router 0.3.2's cache_aware rule, reproduced for fair comparison.

From shared/reference/routers-sglang-vllm.md §2.1 (sglang-router 0.3.2, `policies/cache_aware.rs`):
1. load = the router's own in-flight requests per worker (not what the engine reports);
2. imbalanced iff (max − min) > abs_threshold (64) and max > min × rel_threshold (1.5):
   then the least-loaded worker (first one wins ties);
3. else walk the shared tree; the candidate is the most recent holder of the deepest matched
   node; match_rate = matched / prompt; if match_rate > cache_threshold (0.3) → candidate,
   else the least-loaded worker (first one wins ties — the min-load fallback of PR #14650);
4. the whole request is inserted under the chosen worker; no correction after the response.
The tree is size-bounded per worker with LRU eviction (`max_tree_size`, 2^26 characters in the
CLI; here in tokens at block granularity, 2^26 / 4 by default). Like the real router, it never
learns what the worker evicted earlier than that bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policies.base import Observation, RouteDecision, RouteRequest, WorkerView
from policies.index import IndexConfig
from policies.pools import PoolSettings, available
from policies.prefix_policy import PrefixPolicyBase, SharedSettings
from policies.registry import register_policy


@register_policy("sglang_cache_aware")
class SglangCacheAware(PrefixPolicyBase):
    """sglang-router 0.3.2 cache_aware: threshold 0.3, imbalance gate 64 / 1.5, min-load fallback."""

    name: ClassVar[str]

    def __init__(
        self,
        *,
        seed: int = 0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size_tokens: int = (1 << 26) // 4,
        shared: SharedSettings | None = None,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0 or balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("need 0 <= cache_threshold <= 1, balance_abs_threshold >= 0, rel >= 1")
        if max_tree_size_tokens < 1:
            raise ValueError("max_tree_size_tokens must be >= 1")
        # The router's tree is its own: a per-worker size bound, no TTL, no worker-reported capacity.
        tree = PoolSettings(
            index=IndexConfig(
                default_capacity_tokens=max_tree_size_tokens, max_entries=1 << 26, namespace_share=1.0
            )
        )
        base = shared or SharedSettings()
        super().__init__(
            seed=seed,
            shared=SharedSettings(default_pool=tree, tenants=base.tenants, promotion=base.promotion),
        )
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        cands = available(workers)
        if not cands:
            return None
        pool = self._pool(req)
        self._pools.note_workers(req.pool, cands)
        loads = [w.in_flight_requests for w in cands]
        min_load, max_load = min(loads), max(loads)
        least = cands[loads.index(min_load)]
        imbalanced = (max_load - min_load) > self.balance_abs_threshold and max_load > (
            min_load * self.balance_rel_threshold
        )
        if imbalanced:
            return self._decide(least, "imbalance", 0)
        mine = self._own_keys(req)
        match = pool.index.lookup(mine.keys, mine.namespace, now_s)
        matched = min(match.longest_blocks * req.block_size_tokens, req.n_prompt_tokens)
        rate = matched / req.n_prompt_tokens if req.n_prompt_tokens > 0 else 0.0
        if rate > self.cache_threshold and match.deepest_holder is not None:
            for view in cands:
                if view.worker_id == match.deepest_holder:
                    return self._decide(view, "cache_hit", matched)
        return self._decide(least, "min_load", 0)

    def _decide(self, view: WorkerView, reason: str, matched: int) -> RouteDecision:
        self._decisions.add(reason)
        return RouteDecision(view.worker_id, 0.0, reason, matched)

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        # The whole request is taken as cached on the chosen worker, at once and for good.
        mine = self._own_keys(req)
        self._pool(req).index.record(mine.keys, decision.worker, mine.namespace, now_s, speculative=False)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        return None  # no correction step in the shipped router
