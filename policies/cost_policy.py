"""`cost`, the default policy: send each request where it should get its first token soonest.

For every available worker j, in seconds:

    score_j = T_prefill_saved(j)·(1 + work_weight·L) − T_queue(j) − T_transfer(j) − T_cold(j)

(L = prompts waiting for prefill per worker: a recomputation delays everyone queued behind it),
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
from policies.prefix_policy import PrefixPolicyBase, SharedSettings
from policies.registry import register_policy


@register_policy("cost")
class CostPolicy(PrefixPolicyBase):
    """Score in seconds, bounded-load guard, random tie-break, hot-prefix replication."""

    name: ClassVar[str]
    OBSERVE_EVERY = 32

    def __init__(
        self,
        *,
        seed: int = 0,
        epsilon: float = 0.5,
        slack_requests: float = 8.0,
        work_weight: float = 2.0,
        max_queue_factor: float = 8.0,
        tie_s: float = 1e-4,
        shared: SharedSettings | None = None,
    ) -> None:
        if min(epsilon, slack_requests, tie_s, work_weight, max_queue_factor) < 0:
            raise ValueError("epsilon, slack_requests, tie_s, work_weight and max_queue_factor must be >= 0")
        super().__init__(seed=seed, shared=shared)
        self.epsilon = epsilon
        self.slack_requests = slack_requests
        self.tie_s = tie_s
        self.work_weight = work_weight
        self.max_queue_factor = max_queue_factor
        self._calls = 0
        self._last_n = -1

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        # One pass for availability and load (this loop and the scoring loop below are the
        # per-worker hot path: locals only, no method calls).
        cands: list[WorkerView] = []
        loads: list[int] = []
        backlog_tokens = 0
        for w in workers:
            inflight = w.in_flight_requests
            if not w.healthy or (w.max_in_flight is not None and inflight >= w.max_in_flight):
                continue
            cands.append(w)
            waiting = w.num_requests_waiting
            if waiting is not None:
                reported = waiting + (w.num_requests_running or 0)
                if reported > inflight:
                    inflight = reported
            loads.append(inflight)
            backlog_tokens += w.in_flight_prefill_tokens
        if not cands:
            return None
        self._note_tenant(req)
        pool = self._pool(req)
        self._calls += 1
        if self._calls % self.OBSERVE_EVERY == 1 or len(cands) != self._last_n:
            # Capacities and pool membership change rarely; refresh them periodically.
            self._last_n = len(cands)
            self._pools.note_workers(req.pool, cands)
            pool.observe_workers(cands)
        pool.index.expire(now_s)
        found = self._lookup(pool, req, now_s)
        cost = pool.cost

        mean_after = (sum(loads) + 1) / len(cands)
        # Recomputing a prefix also delays whoever queues behind it: weigh saved compute by
        # 1 + work_weight·L, L = prompts waiting per worker (Little's law), capped.
        waiting_per_worker = backlog_tokens / len(cands) / max(1.0, cost.mean_prompt_tokens)
        weight = 1.0 + self.work_weight * min(waiting_per_worker, self.max_queue_factor)
        bound = max((1.0 + self.epsilon) * mean_after, mean_after + self.slack_requests) - 1
        overloaded = min(loads) > bound
        if overloaded:
            bound = math.inf

        n = req.n_prompt_tokens
        bs = req.block_size_tokens
        limit = self._cap_tokens(req, n)
        longest_tokens = min(found.longest_blocks * bs, limit)
        own = found.own.blocks_by_worker
        public = found.public.blocks_by_worker
        transfer_on = cost.params.transfer_enabled
        q = cost.queue_terms()
        budget = q.max_batched_tokens
        saved_for: dict[int, float] = {0: 0.0}
        best_score = -math.inf
        best: list[tuple[int, int, float]] = []
        tie = self.tie_s
        for i, view in enumerate(cands):
            if loads[i] > bound:
                continue
            blocks = own.get(view.worker_id, 0) if own else 0
            if public:
                blocks = max(blocks, public.get(view.worker_id, 0))
            matched = blocks * bs
            if matched > limit:
                matched = limit
            saved = saved_for.get(matched)
            if saved is None:
                saved = saved_for[matched] = cost.saved_s(n, matched) * weight
            if transfer_on and longest_tokens > matched:
                moved = cost.saved_s(n, longest_tokens) * weight - cost.transfer_s(longest_tokens - matched)
                if moved > saved:
                    saved, matched = moved, longest_tokens
            # T_queue, inlined from CostModel.queue_s (kept equal by a test). The backlog alone
            # bounds the score from above: skip the rest when even that cannot reach a tie.
            backlog = float(view.in_flight_prefill_tokens)
            if saved - q.scale * q.backlog_per_token_s * backlog < best_score - tie:
                continue
            running = known = view.in_flight_requests
            waiting = view.num_requests_waiting
            if waiting is not None:
                scraped = view.num_requests_running or 0
                if waiting + scraped > known:
                    if known > 0 and backlog > 0:
                        backlog *= (waiting + scraped) / known
                    else:
                        backlog += waiting * q.mean_prompt_tokens
                if scraped > running:
                    running = scraped
            per_step = q.per_request_s * running + q.per_context_token_s * view.in_flight_decode_tokens
            queue = -(-int(backlog + n - matched) // budget) * per_step
            if backlog > 0:
                queue += q.backlog_per_token_s * backlog + q.step_s * -(-int(backlog) // budget)
            queue *= q.scale
            score = saved - queue
            if view.warming or (req.adapter and view.loaded_adapters is not None):
                score -= cost.cold_s(view, req.adapter)
            if score > best_score + tie:
                best_score, best = score, [(i, matched, queue)]
            elif score >= best_score - tie:
                if score > best_score:
                    best_score = score
                best.append((i, matched, queue))
        chosen, matched, queue = best[0] if len(best) == 1 else self._rng.choice(best)
        reason = self._reason(overloaded, matched, longest_tokens)
        self._decisions.add(reason)
        cost.note_dispatch(req.request_id, queue, matched)
        return RouteDecision(cands[chosen].worker_id, best_score, reason, matched, found.public_blocks)

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
