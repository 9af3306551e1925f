"""The `cost` decision over many workers equals the plain scan it replaced, decision for decision.

`_PlainScan` is `CostPolicy.select` as it was before `policies/cost_scan.py`: one loop over every
worker's view, every non-holder sorted by backlog, all capacities refreshed every 32 decisions,
each worker scored by `_PlainScorer` (the scorer before its per-decision constants). Both policies
see the same random states (health, caps, scraped counters, backlogs, ties between identical
workers, prefix families that hit, partly hit and miss, transfer on or off, the uncached share
discount on or off), mostly the previous decision's view objects with a few replaced, as a
gateway hands them out (`CandidateCache`), and their decisions and random draws must be
identical. Capacities are left to the default (no reported blocks), so the two refresh schedules
cannot diverge the indexes.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

import pytest

from policies.base import Observation, RouteDecision, RouteRequest, WorkerId, WorkerView, reported_load
from policies.cost_model import CostModel, QueueTerms
from policies.cost_params import CostModelParams
from policies.cost_policy import CostPolicy
from policies.cost_scan import CandidateCache, candidates
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
        drained: list[float] = []
        shares: dict[WorkerId, float] = self._ledger.shares if self.discount_cached_backlog else {}
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
            whole = w.in_flight_prefill_tokens
            drained.append(pending / whole if whole else 1.0)  # the attention drains with the tokens
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
        scorer = _PlainScorer(self, req, cost, q, weight, longest_tokens)
        scorer.drained = drained
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
        cost.note_dispatch(req.request_id, cands[chosen].worker_id, queue, scorer._engine(matched))
        return RouteDecision(cands[chosen].worker_id, scorer.best_score, reason, matched, found.public_blocks)


class _PlainScorer:
    """`cost_scorer.Scorer` as it was before its per-request constants and memos (the reference)."""

    __slots__ = (
        "adapter",
        "best",
        "best_score",
        "branch",
        "cost",
        "drained",
        "limit_tokens",
        "longest_tokens",
        "n",
        "n_steps",
        "nonholder_saved_s",
        "q",
        "saved_for",
        "tie",
        "transfer_on",
        "unit",
        "weight",
    )

    def __init__(
        self,
        policy: CostPolicy,
        req: RouteRequest,
        cost: CostModel,
        q: QueueTerms,
        weight: float,
        longest_tokens: int,
    ) -> None:
        # The scorer works in engine tokens: a request's token count is the normalizer's estimate
        # (approximate mode counts characters / chars_per_token), converted at the learned ratio.
        self.unit = cost.engine_tokens_per_request_token
        self.n = self._engine(req.n_prompt_tokens)
        self.n_steps = -(-self.n // q.max_batched_tokens)
        self.adapter = req.adapter
        self.cost = cost
        self.q = q
        self.weight = weight
        self.tie = policy.tie_s
        self.longest_tokens = longest_tokens
        self.transfer_on = cost.params.transfer_enabled
        self.saved_for: dict[int, float] = {0: 0.0}
        self.best_score = -math.inf
        self.best: list[tuple[int, int, float]] = []
        self.nonholder_saved_s = 0.0
        self.branch: tuple[CostPolicy, float] | None = None
        self.drained: list[float] = []
        if self.transfer_on and longest_tokens > 0:
            longest = self._engine(longest_tokens)
            moved = cost.saved_s(self.n, longest) * weight - cost.transfer_s(longest)
            self.nonholder_saved_s = max(0.0, moved)

    def _engine(self, request_tokens: float) -> int:
        return int(request_tokens) if self.unit == 1.0 else int(request_tokens * self.unit)

    def saved(self, matched: int) -> float:
        """Weighted prefill time a match of `matched` tokens saves (`CostModel.saved_s` inlined and
        memoized per request; a test keeps them equal)."""
        saved = self.saved_for.get(matched)
        if saved is None:
            m = matched if self.unit == 1.0 else int(matched * self.unit)
            if m > self.n:
                m = self.n
            if m <= 0:
                return 0.0
            q = self.q
            steps = self.n_steps - -(-(self.n - m) // q.max_batched_tokens)
            raw = q.prefill_per_token_s * m + q.attention_per_pair_s * m * m / 2 + q.step_s * steps
            saved = self.saved_for[matched] = q.scale * raw * self.weight
        return saved

    def consider(self, i: int, view: WorkerView, matched: int, backlog: float) -> None:
        """Score candidate `i`; `matched` and `backlog` (prefill tokens left to compute, see
        `select`) are in request tokens."""
        cost = self.cost
        q = self.q
        n = self.n
        saved = self.saved(matched)
        longest = self.longest_tokens
        if self.transfer_on and longest > matched:
            moved_tokens = self._engine(longest - matched)
            moved = cost.saved_s(n, self._engine(longest)) * self.weight - cost.transfer_s(moved_tokens)
            if moved > saved:
                saved, matched = moved, longest
        if self.unit != 1.0:
            backlog *= self.unit
        # T_queue, inlined from CostModel.queue_s (kept equal by a test). The backlog alone bounds
        # the score from above: skip the rest when even that cannot reach a tie.
        if saved - q.scale * q.backlog_per_token_s * backlog < self.best_score - self.tie:
            return
        pairs = view.in_flight_prefill_pairs * self.drained[i]
        pairs *= self.unit * self.unit
        pairs = max(pairs, backlog * q.mean_prompt_tokens / 2)
        running = known = view.in_flight_requests
        waiting = view.num_requests_waiting
        if waiting is not None:
            scraped = view.num_requests_running or 0
            at = view.in_flight_at_scrape
            if at is not None:  # `policies.base.reported_load`, inlined: no call per worker
                others = waiting + scraped - at
                if others <= 0:
                    waiting, scraped = 0, known
                else:
                    waiting = others if others < waiting else waiting
                    scraped = known + others - waiting
            if waiting + scraped > known:
                if known > 0 and view.in_flight_prefill_tokens > 0:
                    extra = backlog * ((waiting + scraped) / known - 1)
                    backlog += extra
                    pairs += extra * q.mean_prompt_tokens / 2
                else:
                    backlog += waiting * q.mean_prompt_tokens
                    pairs += waiting * q.mean_prompt_tokens * q.mean_prompt_tokens / 2
            if scraped > running:
                running = scraped
        budget = q.max_batched_tokens
        per_step = q.per_request_s * running + q.per_context_token_s * view.in_flight_decode_tokens
        new = n - (matched if self.unit == 1.0 else int(matched * self.unit))
        queue = -(-int(backlog + new) // budget) * per_step
        if backlog > 0:
            prefill = q.prefill_per_token_s * backlog + q.attention_per_pair_s * pairs
            queue += prefill + q.step_s * -(-int(backlog) // budget)
        queue *= q.scale
        score = saved - queue
        if view.warming or (self.adapter and view.loaded_adapters is not None):
            score -= cost.cold_s(view, self.adapter)
        if self.branch is not None:
            policy, now_s = self.branch
            score -= policy.branch_load_weight * q.scale * policy.recent_work_s(view.worker_id, now_s)
        if score > self.best_score + self.tie:
            self.best_score, self.best = score, [(i, matched, queue)]
        elif score >= self.best_score - self.tie:
            if score > self.best_score:
                self.best_score = score
            self.best.append((i, matched, queue))


def _view(rng: random.Random, i: int, step: int) -> WorkerView:
    if rng.random() < 0.3:
        # Idle and unscraped: identical workers, so ties are common.
        return WorkerView(WorkerId(f"w{i}"))
    inflight = rng.randint(0, 12)
    scraped = rng.random() < 0.6
    return WorkerView(
        WorkerId(f"w{i}"),
        healthy=rng.random() > 0.05,
        in_flight_requests=inflight,
        in_flight_prefill_tokens=(prefill := rng.choice((0, rng.randint(0, 60_000)))),
        in_flight_prefill_pairs=rng.randint(0, prefill * prefill // 2),
        in_flight_decode_tokens=rng.randint(0, 200_000),
        max_in_flight=rng.choice((None, None, 4, 16)),
        num_requests_waiting=rng.randint(0, 5) if scraped else None,
        num_requests_running=rng.randint(0, 14) if scraped else None,
        in_flight_at_scrape=rng.choice((None, rng.randint(0, 14))) if scraped else None,
        warming=rng.random() < 0.03,
        prefill_started_s=rng.choice((None, step * 0.05 - rng.uniform(0.0, 3.0))),
    )


def _views(rng: random.Random, n: int, step: int, before: list[WorkerView]) -> list[WorkerView]:
    """The next decision's views. Mostly the objects of the one before with a few replaced, as the
    gateway's registry hands them out (`CandidateCache` re-reads only those); now and then all new,
    reordered, or a worker more or less."""
    if not before or step % 11 == 5:
        views = [_view(rng, i, step) for i in range(n)]
    else:
        views = list(before)
        for _ in range(rng.choice((0, 1, 1, 2, 3, n // 3 + 1))):
            i = rng.randrange(len(views))
            found = views[i]
            if rng.random() < 0.2:
                views[i] = dataclasses.replace(found)  # a new object, equal to the one it replaces
            else:
                views[i] = dataclasses.replace(_view(rng, i, step), worker_id=found.worker_id)
    if step % 7 == 3:
        rng.shuffle(views)  # the candidate list's order changes now and then
    if step % 13 == 6:
        if len(views) > 1 and rng.random() < 0.5:
            views.pop(rng.randrange(len(views)))
        else:
            views.append(_view(rng, n + step, step))
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
        # The stay rule decides after the scan, from its choice (tests/policies/test_cost_keep.py).
        "stay_objective_s": None,
        "shared": shared,
    }
    new = CostPolicy(seed=seed, **options)  # type: ignore[arg-type]
    old = _PlainScan(seed=seed, **options)  # type: ignore[arg-type]
    n = (1, 3, 8, 40, 130, 300)[seed // 2]
    inflight: list[tuple[RouteRequest, RouteDecision]] = []
    decided = 0
    views: list[WorkerView] = []
    for k in range(300):
        now = k * 0.05
        views = _views(rng, n, k, views)
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


class CountingCache(CandidateCache):
    """A candidate cache kept at every pool size, counting its full rebuilds."""

    MIN_WORKERS = 1
    rebuilds = 0

    def _rebuild(self, workers: Sequence[WorkerView]) -> None:
        self.rebuilds += 1
        super()._rebuild(workers)


@pytest.mark.parametrize("seed", range(6))
def test_candidate_cache_equals_a_fresh_pass(seed: int) -> None:
    rng = random.Random(seed)
    cache = CountingCache()
    n = (3, 8, 40, 130, 300, 1)[seed]
    views: list[WorkerView] = []
    for k in range(400):
        views = _views(rng, n, k, views)
        shares = {v.worker_id: rng.random() for v in views if rng.random() < 0.3} if k % 3 == 0 else {}
        assert cache.candidates(views, shares) == candidates(views, shares), f"step {k}"
    if n >= 8:
        assert cache.rebuilds < 300  # most decisions take in a few changed views


def test_candidate_cache_takes_in_workers_reaching_and_leaving_their_cap() -> None:
    # A saturated pool: every dispatch fills a worker to its cap, every completion frees one.
    rng = random.Random(7)
    views = [WorkerView(WorkerId(f"w{i}"), in_flight_requests=4, max_in_flight=4) for i in range(64)]
    cache = CountingCache()
    for k in range(300):
        i = rng.randrange(len(views))
        inflight = views[i].in_flight_requests + rng.choice((-1, 1))
        views[i] = dataclasses.replace(views[i], in_flight_requests=min(4, max(0, inflight)))
        assert cache.candidates(views, {}) == candidates(views, {}), f"step {k}"
    assert cache.rebuilds == 1
