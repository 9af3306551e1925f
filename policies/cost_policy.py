"""`cost`, the default policy: send each request where it should get its first token soonest.

For every available worker j, in seconds:

    score_j = T_prefill_saved(j)·(1 + work_weight·L) − T_queue(j) − T_transfer(j) − T_cold(j)
              − T_branch(j)

(L = prompts waiting for prefill per worker: a recomputation delays everyone queued behind it;
T_branch = branch_load_weight × prefill seconds recently routed to j, charged only when the best
match covers at most half the prompt, i.e. the request starts a branch its successors will follow;
token counts are in engine tokens, see `CostModel.engine_tokens_per_request_token`), then:
1. bounded-load guard: only workers whose in-flight load stays within
   max((1+ε)·mean, mean + slack) after this request are eligible, unless none is; a worker holding
   more than half the prompt gets `continuation_slack_requests` more, and with `keep_tpot_s` > 0
   stays eligible past any bound while its predicted decode step, with the request's decode
   joining its batch, stays within `keep_tpot_s` (`CostModel.joined_decode_step_s`), and with
   `max_recompute_s` set, past any bound when moving would recompute more than that many
   seconds of the prompt's prefill elsewhere;
2. the best score wins, ties (within `tie_s`) broken at random (so idle workers share misses);
3. hot-prefix spreading falls out of the score: when the holders' queue costs more than the
   prefill they save, a fresh worker wins and the prefix is replicated there (reason "spread");
4. with `herd_weight` > 0, behind a sync broker, when peers' dispatches this gateway cannot see yet
   are common (requests reaching several gateways at once, `policies.herd`): the best of this
   gateway's home share of the workers, among those matching as much of the prompt, wins over a
   better non-home worker within `herd_margin_s`, so that same-instant choices of several
   gateways part instead of all going to the same least-loaded worker;
5. with `herd_hold_steps` > 0, in the same condition, a request whose own predicted prefill is
   long is held before it is decided (`hold_s`, `policies.herd.hold_steps`): one sync lag per step
   it reaches of 0.25 s, 1 s and 4 s, so the cheap requests of an instant, from every gateway, are
   placed (and queued at the engines) before the expensive ones, which then see them;
6. with `ttft_objective_s` set, a request that matches nothing and whose own prefill alone takes
   longer than the objective goes to the eligible worker with the fewest requests in flight (then
   the longest backlog, then at random): it misses the objective wherever it runs, and there it
   delays the fewest requests. Such prompts gather on the few workers already busy with one
   (they hold few requests, since the score steers the rest away), and the others stay quick;
7. with `decode_price_s` > 0, each candidate pays that many seconds for each request in flight
   there whose TPOT this request's prefill would push over `tpot_objective_s`, and, given
   `ttft_objective_s`, a prompt that matches nothing pays it where it would miss that objective
   (`policies.cost_decode`);
8. with `stay_objective_s` set, when the chosen worker's first token is predicted later than it and
   a holder of more than half the prompt, within the load guard, is predicted within
   `stay_within_s` and its decode step with the request joining within `stay_tpot_s`, the
   request stays with that holder (`policies.cost_keep`): the score counts
   the holder's backlog whole, which a session's previous turn still in prefill, mostly cached and
   partly computed, makes look seconds away. A `stay_within_s` above `stay_objective_s` also keeps
   turns that miss the objective either way, on their holders (which saves recomputing them); a
   turn whose client waited for the answer before it has `stay_waited_within_s` instead
   (`policies.cost_turns`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar, Literal

from policies.base import RouteDecision, RouteRequest, WorkerView
from policies.cost_books import CostBooks
from policies.cost_decode import DecodePrice
from policies.cost_keep import stay
from policies.cost_scan import CandidateCache, Positions, by_backlog, fewest_in_flight
from policies.cost_scorer import Scorer
from policies.cost_turns import TurnChains
from policies.herd import HOLD_STEPS_S
from policies.prefix_policy import SharedSettings, servable_tokens
from policies.registry import register_policy


@register_policy("cost")
class CostPolicy(CostBooks):
    """Score in seconds, bounded-load guard, random tie-break, hot-prefix replication."""

    name: ClassVar[str]
    OBSERVE_EVERY = 32
    OBSERVE_SLICE = 8
    MAX_CACHED_POOLS = 32

    def __init__(
        self,
        *,
        seed: int = 0,
        epsilon: float = 0.5,
        slack_requests: float = 8.0,
        work_weight: float = 2.0,
        max_queue_factor: float = 8.0,
        tie_s: float = 1e-4,
        branch_load_weight: float = 1.0,
        load_window_s: float = 180.0,
        discount_cached_backlog: bool | Literal["holders"] | None = None,
        continuation_slack_requests: float = 0.0,
        keep_tpot_s: float = 0.0,
        max_recompute_s: float | None = None,
        herd_weight: float = 2.0,
        herd_hold_steps: int = len(HOLD_STEPS_S),
        ttft_objective_s: float | None = None,
        decode_price_s: float = 0.0,
        tpot_objective_s: float = 0.1,
        stay_objective_s: float | None = 1.4,
        stay_within_s: float = 0.7,
        stay_tpot_s: float = 0.05,
        stay_waited_within_s: float | None = 3.0,
        shared: SharedSettings | None = None,
    ) -> None:
        if (
            min(
                epsilon,
                slack_requests,
                tie_s,
                work_weight,
                max_queue_factor,
                branch_load_weight,
                continuation_slack_requests,
                keep_tpot_s,
                herd_weight,
                herd_hold_steps,
                decode_price_s,
                stay_within_s,
                stay_tpot_s,
            )
            < 0
        ):
            raise ValueError(
                "epsilon, slack_requests, tie_s, work_weight, max_queue_factor, branch_load_weight,"
                " continuation_slack_requests, keep_tpot_s, herd_weight, herd_hold_steps,"
                " decode_price_s, stay_within_s and stay_tpot_s must be >= 0"
            )
        if load_window_s <= 0:
            raise ValueError("load_window_s must be > 0")
        if herd_hold_steps > len(HOLD_STEPS_S):
            raise ValueError(f"herd_hold_steps must be <= {len(HOLD_STEPS_S)}")
        if discount_cached_backlog not in (None, True, False, "holders"):
            raise ValueError("discount_cached_backlog must be true, false, 'holders' or None")
        if max_recompute_s is not None and max_recompute_s <= 0:
            raise ValueError("max_recompute_s must be > 0 (or None: off)")
        if ttft_objective_s is not None and ttft_objective_s <= 0:
            raise ValueError("ttft_objective_s must be > 0 (or None: off)")
        if tpot_objective_s <= 0:
            raise ValueError("tpot_objective_s must be > 0")
        if stay_objective_s is not None and stay_objective_s <= 0:
            raise ValueError("stay_objective_s must be > 0 (or None: off)")
        if stay_waited_within_s is not None and stay_waited_within_s < 0:
            raise ValueError("stay_waited_within_s must be >= 0 (or None: as stay_within_s)")
        super().__init__(seed=seed, shared=shared, load_window_s=load_window_s)
        self.epsilon = epsilon
        self.slack_requests = slack_requests
        self.tie_s = tie_s
        self.work_weight = work_weight
        self.max_queue_factor = max_queue_factor
        self.branch_load_weight = branch_load_weight
        # None: counted in uncached tokens on pools whose workers move KV (`pool_moves_kv`).
        self.discount_cached_backlog = discount_cached_backlog
        self.continuation_slack_requests = continuation_slack_requests
        self.keep_tpot_s = keep_tpot_s
        self.max_recompute_s = max_recompute_s
        self.herd_weight = herd_weight
        self.herd_hold_steps = herd_hold_steps
        self.ttft_objective_s = ttft_objective_s
        self.decode_price_s = decode_price_s
        self.records_decodes = decode_price_s > 0
        self.tpot_objective_s = tpot_objective_s
        self.stay_objective_s = stay_objective_s
        self.stay_within_s = stay_within_s
        self.stay_tpot_s = stay_tpot_s
        self.stay_waited_within_s = stay_waited_within_s
        if stay_waited_within_s is not None and stay_objective_s is not None:
            self._turns = TurnChains()
        self._last_n = -1
        self._observe_step = 1
        self._positions = Positions()
        self._columns: OrderedDict[str, CandidateCache] = OrderedDict()
        self._observe_at = 0

    def retire(self) -> None:
        super().retire()
        self._columns = OrderedDict()

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        pool = self._pools.get(req.pool, req.block_size_tokens)  # `_pool`, inlined
        pool.index.expire(now_s)
        mine = self._own_keys(req)
        own_match = pool.index.lookup(mine.keys, mine.namespace, now_s)
        # Pass 1: availability, load and prefill backlog of every worker, re-read only where a view
        # changed since the pool's last decision (see `cost_scan`).
        shares = self._ledger.shares if self.discounts_backlog(req.pool) else {}
        remaining = pool.cost.remaining_at(now_s)
        cache = self._columns.get(req.pool) or self._candidate_cache(req.pool)
        columns = cache.candidates(workers, shares, remaining)
        cands, loads, backlogs = columns.views, columns.loads, columns.backlogs
        if not cands:
            return None
        n_cands = len(cands)
        if self.shared.tenants:
            self._note_tenant(req)
        if n_cands != self._last_n:
            self._last_n = n_cands
            # Capacities and pool membership change rarely: each decision refreshes the next few
            # workers (at most OBSERVE_SLICE), so each is seen every max(OBSERVE_EVERY, workers /
            # OBSERVE_SLICE) decisions, at a flat cost per decision.
            self._observe_step = min(self.OBSERVE_SLICE, -(-n_cands // self.OBSERVE_EVERY))
            self._pools.note_workers(req.pool, cands)
            pool.observe_workers(cands)
        else:
            step = self._observe_step
            start = self._observe_at if self._observe_at < n_cands else 0
            self._observe_at = start + step
            part = cands[start : start + step]
            self._pools.note_workers(req.pool, part)
            pool.observe_workers(part)
        found = self._lookup(pool, req, now_s, own=own_match)
        # Wholly inside a promoted public prefix, the request carries the public salt, so only
        # public holders save it anything (its tenant-salted blocks are not reused).
        match = found.public if found.public_blocks else own_match
        cost = pool.cost
        q = cost.queue_terms()

        mean_after = (columns.total_load + 1) / n_cands
        # Recomputing a prefix also delays whoever queues behind it: weigh saved compute by
        # 1 + work_weight·L, L = prompts waiting per worker (Little's law), capped. The backlog is
        # in request tokens and the mean prompt in engine tokens: convert before dividing.
        # (min() and max() are written as conditional expressions here and below, each picking what
        # the builtin picks: a builtin call costs more than the comparison.)
        unit = cost.engine_tokens_per_request_token
        mean_prompt = q.mean_prompt_tokens
        waiting_per_worker = (
            columns.raw_backlog * unit / n_cands / (mean_prompt if mean_prompt > 1.0 else 1.0)
        )
        factor = self.max_queue_factor
        weight = 1.0 + self.work_weight * (factor if factor < waiting_per_worker else waiting_per_worker)
        relative, absolute = (1.0 + self.epsilon) * mean_after, mean_after + self.slack_requests
        bound = (absolute if absolute > relative else relative) - 1
        # The least loaded worker is at most the mean: with a slack of a request or more, it is
        # always within the bound, and the pass over the loads is skipped.
        overloaded = self.slack_requests < 1 and min(loads) > bound
        if overloaded:
            bound = math.inf

        n = req.n_prompt_tokens
        bs = req.block_size_tokens
        limit = servable_tokens(n, bs)
        longest_tokens = match.longest_blocks * bs
        if longest_tokens > limit:
            longest_tokens = limit
        scorer = Scorer(self.tie_s, req, cost, q, weight, longest_tokens)
        if remaining is not None:
            scorer.drained(columns.pending)
        # Without a sync sink no peer dispatch goes unseen: no margin (`herd_margin_s` is 0).
        herd_s = 0.0 if self._sync_sink is None else self.herd_margin_s(q.scale)
        if herd_s > 0:
            scorer.keep_near(herd_s)
        if self.branch_load_weight > 0 and 2 * longest_tokens <= n:
            # Most of the prompt is new: it starts a branch (a new session or a fork) whose next
            # requests will follow it to this worker. Charge each worker the work recently routed
            # to it, so branches spread over the pool by long-run load, not only by the queue now.
            scorer.charge_branches(
                self._recent_work.by_worker, self.branch_load_weight, self.load_window_s, now_s
            )

        objective = self.ttft_objective_s
        # A prompt that matches nothing is also charged where it would miss the TTFT objective.
        own_objective = objective if longest_tokens == 0 else None
        if self.decode_price_s > 0 and (own_objective is not None or self._decodes.by_worker):
            # (With nothing in flight to slow and no objective of its own, nothing is charged.)
            scorer.price_decodes(
                DecodePrice(
                    self.decode_price_s,
                    self.tpot_objective_s,
                    own_objective,
                    self._decodes,
                    cost,
                    scorer.n,
                    now_s,
                )
            )
        if objective is not None and longest_tokens == 0 and cost.prefill_s(scorer.n) > objective:
            # Step 6 of the module docstring: no worker can meet the objective for this prompt.
            lane = fewest_in_flight(loads, backlogs, bound, self._rng)
            scorer.consider(lane, cands[lane], 0, backlogs[lane])
            self._count("objective_lanes")
            return self._decided(
                req, cands, scorer, scorer.best[0], overloaded, longest_tokens, found.public_blocks
            )

        # A worker's score is at most what it saves minus its raw backlog's prefill time at the
        # mean prompt's attention (the queue's smallest term, before scaling for requests this
        # gateway did not send: a backlog's attention is never counted below it). Workers are
        # scored in order of that bound, and once it falls below the best score less the tie margin
        # no later worker can win or tie: the loop stops there.
        reach = scorer.reach
        per_backlog_token = q.scale * q.backlog_per_token_s * cost.engine_tokens_per_request_token
        # Pass 2a: the workers holding part of the prefix (few), in `match` (see above).
        held = self._positions.held(cands, match.blocks_by_worker) if match.longest_blocks else []
        holders: set[int] = set()
        # The holders the guard (or its exemptions for a holder of most of the prompt) lets in.
        eligible_holders: set[int] = set()
        if held:
            # A worker holding more than half the prompt gets more room under the load guard: its
            # load is mostly the decodes of the sessions it holds, and recomputing the history
            # elsewhere adds more prefill to the pool than it moves (the score prices its queue).
            follow_bound = bound + self.continuation_slack_requests
            keep_s = self.keep_tpot_s
            # What a move would recompute is the prefill the holder saves: `saved` weighs it by
            # the queue factor, and so is the limit here.
            recompute = self.max_recompute_s
            stay_s = math.inf if recompute is None else recompute * weight
            ranked: list[tuple[float, int, int, float]] = []
            guarded = False
            # With `discount_cached_backlog: holders`, a holder of most of the prompt counts its
            # backlog as what is left to compute (its in-flight prompts' predicted uncached share):
            # its sessions' turns are mostly cached, and counted whole they make it look seconds
            # away (docs/benchmarks.md, "The agent trace ... in a closed loop").
            share = self._ledger.share if self.discounts_holders(req.pool) else None
            for i, blocks in held:
                holders.add(i)
                matched = blocks * bs
                matched = limit if limit < matched else matched
                if (
                    loads[i] <= bound
                    or (2 * matched > n and loads[i] <= follow_bound)
                    or (2 * matched > n and scorer.saved(matched) > stay_s)
                    or (
                        keep_s > 0
                        and 2 * matched > n
                        and cost.joined_decode_step_s(cands[i], loads[i], req) <= keep_s
                    )
                ):
                    saved, moved = scorer.saved(matched), scorer.nonholder_saved_s
                    upper = moved if moved > saved else saved
                    backlog = backlogs[i]
                    if share is not None and 2 * matched > n:
                        backlog *= share(cands[i].worker_id)
                    ranked.append((upper - per_backlog_token * backlog, i, matched, backlog))
                    eligible_holders.add(i)
                elif 2 * matched > n:
                    guarded = True
            if guarded:
                # A holder of most of the prompt was past the load guard: the move (if the
                # request leaves) is the guard's, not the score's (`policy.md`, tuning the guard).
                self._count("holders_past_guard")
            ranked.sort(reverse=True)
            for upper, i, matched, backlog in ranked:
                if upper < scorer.best_score - reach:
                    break
                scorer.consider(i, cands[i], matched, backlog)
        # Pass 2b: the others (they save nothing, or at most a transfer), by raw backlog
        # (`cost_scan.by_backlog`): a hit usually stops after a few of them, a miss scores every
        # worker the backlog bound cannot rule out (each one's queue and branch charge differ).
        cap_s = scorer.nonholder_saved_s
        if cap_s >= scorer.best_score - reach and len(holders) < n_cands:
            for i in by_backlog(columns):
                if loads[i] > bound or i in holders:
                    continue
                if cap_s - per_backlog_token * backlogs[i] < scorer.best_score - reach:
                    break
                scorer.consider(i, cands[i], 0, backlogs[i])
        best = scorer.best
        if len(best) == 1:
            chosen, matched, queue = best[0]
        else:
            best.sort()
            chosen, matched, queue = self._rng.choice(best)
        score = scorer.best_score
        over_s = self.stay_objective_s
        within_s = self.stay_within_s
        turns, waited_s = self._turns, self.stay_waited_within_s
        if turns is not None and waited_s is not None and turns.arrived(req.block_keys, match.longest_blocks):
            within_s = waited_s  # its client waited for the answer before it (`cost_turns`)
        if over_s is not None and held:
            # Step 8 of the module docstring (`policies.cost_keep`).
            kept = stay(
                cost,
                cands,
                held,
                eligible=lambda i: (
                    i in eligible_holders
                    and cost.joined_decode_step_s(cands[i], loads[i], req) <= self.stay_tpot_s
                ),
                share=self._ledger.pending_share,
                chosen=(chosen, matched),
                prompt_tokens=n,
                limit_tokens=limit,
                block_size_tokens=bs,
                now_s=now_s,
                within_s=within_s,
                over_s=over_s,
            )
            if kept is not None:
                self._count("stays_within_objective")
                chosen, matched, queue = kept.index, kept.matched_tokens, kept.wait_s
                score = scorer.saved(matched) - queue - cost.cold_s(cands[chosen], req.adapter)
                herd_s = 0.0  # the stay is the better-informed choice: the herd does not undo it
        if herd_s > 0:
            home = self._home_choice(scorer, workers, cands, chosen, matched, herd_s, now_s)
            if home is not None:
                score, chosen, matched, queue = home
        return self._decided(
            req,
            cands,
            scorer,
            (chosen, matched, queue),
            overloaded,
            longest_tokens,
            found.public_blocks,
            score,
        )

    def _decided(
        self,
        req: RouteRequest,
        cands: Sequence[WorkerView],
        scorer: Scorer,
        choice: tuple[int, int, float],
        overloaded: bool,
        longest_tokens: int,
        public_blocks: int,
        score: float | None = None,
    ) -> RouteDecision:
        """Record the choice (its reason; the queue the cost model expects, for calibration)."""
        chosen, matched, queue = choice
        reason = self._reason(overloaded, matched, longest_tokens)
        self._decisions.add(reason)
        unit = scorer.unit
        worker = cands[chosen].worker_id
        scorer.cost.note_dispatch(
            req.request_id, worker, queue, matched if unit == 1.0 else int(matched * unit)
        )
        if score is None:
            score = scorer.best_score
        return RouteDecision(worker, score, reason, matched, public_blocks)

    def _candidate_cache(self, pool: str) -> CandidateCache:
        cache = self._columns.get(pool)
        if cache is None:
            if len(self._columns) >= self.MAX_CACHED_POOLS:
                self._columns.popitem(last=False)
            cache = self._columns[pool] = CandidateCache()
        return cache

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
