"""The `cost` decision over many workers equals the plain scan it replaced, decision for decision.

`_PlainScan` is `CostPolicy.select` as it was before `policies/cost_scan.py`: one loop over every
worker's view, every non-holder sorted by backlog, all capacities refreshed every 32 decisions. Both
policies see the same random states (health, caps, scraped counters, backlogs, ties between
identical workers, prefix families that hit, partly hit and miss, transfer on or off, the uncached
share discount on or off), and their decisions and random draws must be identical. Capacities are
left to the default (no reported blocks), so the two refresh schedules cannot diverge the indexes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from policies.base import Observation, RouteDecision, RouteRequest, WorkerId, WorkerView, reported_load
from policies.cost_model import CostModelParams
from policies.cost_policy import CostPolicy, _Scorer
from policies.pools import PoolSettings
from policies.prefix_policy import SharedSettings
from tests.policies.factories import req


class _PlainScan(CostPolicy):
    _ref_calls = 0

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        pool = self._pool(req)
        pool.index.expire(now_s)
        mine = self._own_keys(req)
        own_match = pool.index.lookup(mine.keys, mine.namespace, now_s)
        own_get = own_match.blocks_by_worker.get if own_match.longest_blocks else None
        # Pass 1: availability, load, raw prefill backlog and own-namespace match of every worker
        # (locals only: this and the scoring below are the per-worker hot path).
        cands: list[WorkerView] = []
        loads: list[int] = []
        backlogs: list[float] = []  # prefill tokens left to compute (whole prompts × uncached share)
        held: list[tuple[int, int]] = []  # (candidate, matched blocks)
        raw_backlog = 0
        shares: dict[WorkerId, float] = self._uncached_share if self.discount_cached_backlog else {}
        for w in workers:
            inflight = w.in_flight_requests
            if not w.healthy or (w.max_in_flight is not None and inflight >= w.max_in_flight):
                continue
            if own_get is not None:
                blocks = own_get(w.worker_id)
                if blocks:
                    held.append((len(cands), blocks))
            cands.append(w)
            if w.num_requests_waiting is not None:
                reported = sum(reported_load(w) or ())
                if reported > inflight:
                    inflight = reported
            loads.append(inflight)
            raw_backlog += w.in_flight_prefill_tokens
            pending = pool.cost.prefill_remaining(w, now_s)  # less its progress (`prefill_progress`)
            backlogs.append(pending * shares.get(w.worker_id, 1.0) if shares else pending)
        if not cands:
            return None
        n_cands = len(cands)
        self._note_tenant(req)
        self._ref_calls += 1
        if self._ref_calls % self.OBSERVE_EVERY == 1 or n_cands != self._last_n:
            # Capacities and pool membership change rarely; refresh them periodically.
            self._last_n = n_cands
            self._pools.note_workers(req.pool, cands)
            pool.observe_workers(cands)
        found = self._lookup(pool, req, now_s, own=own_match)
        cost = pool.cost

        mean_after = (sum(loads) + 1) / n_cands
        # Recomputing a prefix also delays whoever queues behind it: weigh saved compute by
        # 1 + work_weight·L, L = prompts waiting per worker (Little's law), capped. The backlog is
        # in request tokens and the mean prompt in engine tokens: convert before dividing.
        unit = cost.engine_tokens_per_request_token
        waiting_per_worker = raw_backlog * unit / n_cands / max(1.0, cost.mean_prompt_tokens)
        weight = 1.0 + self.work_weight * min(waiting_per_worker, self.max_queue_factor)
        bound = max((1.0 + self.epsilon) * mean_after, mean_after + self.slack_requests) - 1
        overloaded = min(loads) > bound
        if overloaded:
            bound = math.inf

        n = req.n_prompt_tokens
        bs = req.block_size_tokens
        limit = self._cap_tokens(req, n)
        longest_tokens = min(found.longest_blocks * bs, limit)
        q = cost.queue_terms()
        scorer = _Scorer(self, req, cost, q, weight, longest_tokens)
        if self.branch_load_weight > 0 and 2 * longest_tokens <= n:
            # Most of the prompt is new: it starts a branch (a new session or a fork) whose next
            # requests will follow it to this worker. Charge each worker the work recently routed
            # to it, so branches spread over the pool by long-run load, not only by the queue now.
            scorer.branch = (self, now_s)

        # A worker's score is at most what it saves minus its raw backlog's prefill time (the
        # queue's smallest term, before scaling for requests this gateway did not send). Workers are
        # scored in order of that bound, and once it falls below the best score less the tie margin
        # no later worker can win or tie: the loop stops there.
        tie = self.tie_s
        per_backlog_token = q.scale * q.backlog_per_token_s * cost.engine_tokens_per_request_token
        # Pass 2a: the workers holding part of the prefix (few).
        if found.public_blocks:
            # Wholly inside a promoted public prefix: the request carries the public salt, so only
            # public holders save it anything (its tenant-salted blocks are not reused).
            public = found.public.blocks_by_worker
            held = [(i, public[v.worker_id]) for i, v in enumerate(cands) if public.get(v.worker_id, 0)]
        holders: set[int] = set()
        if held:
            # A worker holding more than half the prompt gets more room under the load guard: its
            # load is mostly the decodes of the sessions it holds, and recomputing the history
            # elsewhere adds more prefill to the pool than it moves (the score prices its queue).
            follow_bound = bound + self.continuation_slack_requests
            ranked: list[tuple[float, int, int]] = []
            for i, blocks in held:
                holders.add(i)
                matched = min(blocks * bs, limit)
                if loads[i] <= bound or (2 * matched > n and loads[i] <= follow_bound):
                    upper = max(scorer.saved(matched), scorer.nonholder_saved_s)
                    ranked.append((upper - per_backlog_token * backlogs[i], i, matched))
            ranked.sort(reverse=True)
            for upper, i, matched in ranked:
                if upper < scorer.best_score - tie:
                    break
                scorer.consider(i, cands[i], matched, backlogs[i])
        # Pass 2b: the others (they save nothing, or at most a transfer), by raw backlog.
        cap_s = scorer.nonholder_saved_s
        if cap_s >= scorer.best_score - tie:
            order = [i for i in range(n_cands) if loads[i] <= bound and i not in holders]
            order.sort(key=backlogs.__getitem__)
            for i in order:
                if cap_s - per_backlog_token * backlogs[i] < scorer.best_score - tie:
                    break
                scorer.consider(i, cands[i], 0, backlogs[i])
        best = scorer.best
        if len(best) == 1:
            chosen, matched, queue = best[0]
        else:
            best.sort()
            chosen, matched, queue = self._rng.choice(best)
        reason = self._reason(overloaded, matched, longest_tokens)
        self._decisions.add(reason)
        cost.note_dispatch(req.request_id, queue, scorer._engine(matched))
        return RouteDecision(cands[chosen].worker_id, scorer.best_score, reason, matched, found.public_blocks)


def _views(rng: random.Random, n: int, step: int) -> list[WorkerView]:
    views = []
    for i in range(n):
        if rng.random() < 0.3:
            # Idle and unscraped: identical workers, so ties are common.
            views.append(WorkerView(WorkerId(f"w{i}")))
            continue
        inflight = rng.randint(0, 12)
        scraped = rng.random() < 0.6
        views.append(
            WorkerView(
                WorkerId(f"w{i}"),
                healthy=rng.random() > 0.05,
                in_flight_requests=inflight,
                in_flight_prefill_tokens=rng.choice((0, rng.randint(0, 60_000))),
                in_flight_decode_tokens=rng.randint(0, 200_000),
                max_in_flight=rng.choice((None, None, 4, 16)),
                num_requests_waiting=rng.randint(0, 5) if scraped else None,
                num_requests_running=rng.randint(0, 14) if scraped else None,
                in_flight_at_scrape=rng.choice((None, rng.randint(0, 14))) if scraped else None,
                warming=rng.random() < 0.03,
                prefill_started_s=rng.choice((None, step * 0.05 - rng.uniform(0.0, 3.0))),
            )
        )
    if step % 7 == 3:
        rng.shuffle(views)  # the candidate list's order changes now and then
    return views


def _request(rng: random.Random, k: int) -> RouteRequest:
    family = rng.randint(0, 5)
    depth = rng.choice((4, 16, 40, 128))
    tail = rng.randint(0, 3)
    blocks = [family * 10_000 + j for j in range(depth)] + [k * 1_000_000 + j for j in range(tail)]
    return req(f"r{k}", blocks, tenant=f"t{rng.randint(0, 1)}")


@pytest.mark.parametrize("seed", range(12))
def test_decisions_equal_the_plain_scan(seed: int) -> None:
    rng = random.Random(seed)
    transfer = seed % 3 == 1
    progress = (0.0, 1.0)[seed % 4 // 2]  # the backlog less its progress since dispatch, or whole
    params = CostModelParams(transfer_enabled=transfer, prefill_progress=progress)
    shared = SharedSettings(default_pool=PoolSettings(cost=params))
    options: dict[str, object] = {
        "discount_cached_backlog": seed % 2 == 0,
        "tie_s": (1e-4, 1e-2, 0.5)[seed % 3],
        "slack_requests": (8.0, 0.0, 0.5)[seed % 4 % 3],
        "shared": shared,
    }
    new = CostPolicy(seed=seed, **options)  # type: ignore[arg-type]
    old = _PlainScan(seed=seed, **options)  # type: ignore[arg-type]
    n = rng.choice((1, 3, 8, 40, 130))
    inflight: list[tuple[RouteRequest, RouteDecision]] = []
    decided = 0
    for k in range(300):
        now = k * 0.05
        views = _views(rng, n, k)
        r = _request(rng, k)
        d_new = new.select(r, views, now)
        d_old = old.select(r, views, now)
        assert d_new == d_old, f"step {k}"
        assert new._rng.getstate() == old._rng.getstate()
        if d_new is None:
            continue
        decided += 1
        for p in (new, old):
            p.on_dispatch(r, d_new, now)
        inflight.append((r, d_new))
        while inflight and rng.random() < 0.5:
            done, d = inflight.pop(rng.randrange(len(inflight)))
            ttft = rng.uniform(0.01, 2.0)
            for p in (new, old):
                p.on_complete(
                    Observation(done, d.worker, ttft_s=ttft, prompt_tokens=done.n_prompt_tokens), now
                )
    assert decided > 100
    new.check_invariants()
