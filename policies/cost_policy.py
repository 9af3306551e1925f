"""`cost`, the default policy: send each request where it should get its first token soonest.

For every available worker j, in seconds:

    score_j = T_prefill_saved(j) − T_queue(j) − T_transfer(j) − T_cold(j)

then:
1. bounded-load guard: only workers whose in-flight load stays within
   max((1+ε)·mean, mean + slack) after this request are eligible, unless none is;
2. the best score wins, ties (within `tie_s`) broken at random (so idle workers share misses);
3. hot-prefix spreading falls out of the score: when the holders' queue costs more than the
   prefill they save, a fresh worker wins and the prefix is replicated there (reason "spread").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from policies.base import RouteDecision, RouteRequest, WorkerView
from policies.pools import available, load_of
from policies.prefix_policy import PrefixPolicyBase, SharedSettings
from policies.registry import register_policy


@register_policy("cost")
class CostPolicy(PrefixPolicyBase):
    """Score in seconds, bounded-load guard, random tie-break, hot-prefix replication."""

    name: ClassVar[str]

    def __init__(
        self,
        *,
        seed: int = 0,
        epsilon: float = 0.25,
        slack_requests: float = 2.0,
        tie_s: float = 1e-4,
        shared: SharedSettings | None = None,
    ) -> None:
        if epsilon < 0 or slack_requests < 0 or tie_s < 0:
            raise ValueError("epsilon, slack_requests and tie_s must be >= 0")
        super().__init__(seed=seed, shared=shared)
        self.epsilon = epsilon
        self.slack_requests = slack_requests
        self.tie_s = tie_s

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        cands = available(workers)
        if not cands:
            return None
        self._note_tenant(req)
        pool = self._pool(req)
        self._pools.note_workers(req.pool, cands)
        pool.observe_workers(cands)
        pool.index.expire(now_s)
        found = self._lookup(pool, req, now_s)
        cost = pool.cost

        loads = [load_of(w) for w in cands]
        mean_after = (sum(loads) + 1) / len(cands)
        bound = max((1.0 + self.epsilon) * mean_after, mean_after + self.slack_requests)
        eligible = [i for i, load in enumerate(loads) if load + 1 <= bound]
        overloaded = not eligible
        if overloaded:
            eligible = list(range(len(cands)))

        n = req.n_prompt_tokens
        longest_tokens = self._cap_tokens(req, found.longest_blocks)
        transfer_on = cost.params.transfer_enabled
        best_score = -math.inf
        best: list[int] = []
        matched_of: dict[int, int] = {}
        queue_of: dict[int, float] = {}
        for i in eligible:
            view = cands[i]
            matched = self._cap_tokens(req, found.blocks(view.worker_id))
            saved = cost.saved_s(n, matched)
            if transfer_on and longest_tokens > matched:
                moved = cost.saved_s(n, longest_tokens) - cost.transfer_s(longest_tokens - matched)
                if moved > saved:
                    saved, matched = moved, longest_tokens
            queue = cost.queue_s(view, n - matched)
            score = saved - queue - cost.cold_s(view, req.adapter)
            matched_of[i], queue_of[i] = matched, queue
            if score > best_score + self.tie_s:
                best_score, best = score, [i]
            elif score >= best_score - self.tie_s:
                if score > best_score:
                    best_score = score
                best.append(i)
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        matched = matched_of[chosen]
        reason = self._reason(overloaded, matched, longest_tokens)
        self._decisions.add(reason)
        cost.note_dispatch(req.request_id, queue_of[chosen], matched)
        view = cands[chosen]
        return RouteDecision(view.worker_id, best_score, reason, matched, found.public_blocks)

    def _reason(self, overloaded: bool, matched: int, longest: int) -> str:
        if overloaded:
            return "overloaded"
        if longest == 0:
            return "miss"
        if matched >= longest:
            return "hit"
        if matched == 0:
            self._count("hot_prefix_replications")
        return "spread"
