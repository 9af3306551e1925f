"""One `cost` decision's scoring of candidates (`policies.cost_policy`), one worker at a time.

`CostModel.saved_s` and `CostModel.queue_s` are inlined here, with everything that depends only on
the request and the match length computed once per decision: a miss scores most workers, so the
per-worker part is kept to a few arithmetic operations (tests keep the inlined forms equal to the
model's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.base import RouteRequest, WorkerId, WorkerView
from policies.cost_decode import DecodePrice
from policies.cost_model import CostModel, QueueTerms


class Scorer:
    """Scores candidates one at a time and keeps the best (ties within `tie_s` kept together)."""

    __slots__ = (
        "adapter",
        "backlog_s_per_token",
        "best",
        "best_score",
        "branch_s",
        "cost",
        "limit_tokens",
        "longest_tokens",
        "moved_for",
        "n",
        "n_steps",
        "near",
        "nonholder_saved_s",
        "now_s",
        "pending",
        "price",
        "q",
        "reach",
        "recent",
        "saved_for",
        "tie",
        "transfer_on",
        "unit",
        "weight",
        "window_s",
    )

    def __init__(
        self,
        tie_s: float,
        req: RouteRequest,
        cost: CostModel,
        q: QueueTerms,
        weight: float,
        longest_tokens: int,
    ) -> None:
        # The scorer works in engine tokens: a request's token count is the normalizer's estimate
        # (approximate mode counts characters / chars_per_token), converted at the learned ratio.
        self.unit = unit = cost.engine_tokens_per_request_token
        n = req.n_prompt_tokens
        self.n = n = int(n) if unit == 1.0 else int(n * unit)  # `_engine`, inlined
        self.n_steps = -(-n // q.max_batched_tokens)
        self.adapter = req.adapter
        self.cost = cost
        self.q = q
        self.weight = weight
        self.tie = tie_s
        # How far below the best a candidate may score and still matter: the tie margin, widened by
        # `keep_near` to collect the candidates within a margin (`near`, None: not kept).
        self.reach = tie_s
        self.near: list[tuple[float, int, int, float]] | None = None
        self.longest_tokens = longest_tokens
        self.transfer_on = cost.params.transfer_enabled
        self.saved_for: dict[int, float] = {0: 0.0}
        self.moved_for: dict[int, float] = {}
        # The least a backlog token can cost (its attention at least the mean prompt's): the bound.
        self.backlog_s_per_token = q.scale * q.backlog_per_token_s
        self.best_score = -math.inf
        self.best: list[tuple[int, int, float]] = []
        self.nonholder_saved_s = 0.0
        # Each candidate's prefill tokens left (`drained`): None, every backlog is whole.
        self.pending: Sequence[int] | None = None
        # The branch charge (`charge_branches`): off until then.
        self.recent: dict[WorkerId, tuple[float, float]] | None = None
        self.branch_s = 0.0
        self.now_s = 0.0
        self.window_s = 1.0
        # The decode price (`price_decodes`): off until then.
        self.price: DecodePrice | None = None
        if self.transfer_on and longest_tokens > 0:
            longest = self._engine(longest_tokens)
            moved = cost.saved_s(self.n, longest) * weight - cost.transfer_s(longest)
            self.nonholder_saved_s = max(0.0, moved)

    def keep_near(self, margin_s: float) -> None:
        """Also keep, in `near`, every candidate scoring within `margin_s` (plus the tie margin) of
        the best at the time it was scored: (score, index, matched, queue)."""
        self.reach = self.tie + margin_s
        self.near = []

    def drained(self, pending: Sequence[int]) -> None:
        """The candidates' backlogs have drained to `pending` (`CostModel.prefill_remaining`, by
        candidate index): their attention drains with them."""
        self.pending = pending

    def _engine(self, request_tokens: float) -> int:
        return int(request_tokens) if self.unit == 1.0 else int(request_tokens * self.unit)

    def charge_branches(
        self, recent: dict[WorkerId, tuple[float, float]], weight: float, window_s: float, now_s: float
    ) -> None:
        """Charge each worker the prefill seconds recently routed there (`recent`: work and when,
        decaying over `window_s`; `CostPolicy.recent_work_s` inlined), at `weight` × the current
        scale."""
        self.recent = recent
        self.branch_s = weight * self.q.scale
        self.now_s = now_s
        self.window_s = window_s

    def price_decodes(self, price: DecodePrice) -> None:
        """Charge each candidate `price` (`policies.cost_decode`): seconds for each miss, TTFT or
        TPOT, this request's prefill there is predicted to cause."""
        self.price = price

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
        # Everything that depends only on the request and the match length is computed once per
        # decision (`saved_for`, `moved_for`, the scaled constants): a miss scores most workers.
        saved = self.saved_for.get(matched)
        if saved is None:
            saved = self.saved(matched)
        longest = self.longest_tokens
        if self.transfer_on and longest > matched:
            moved = self.moved_for.get(matched)
            if moved is None:
                cost = self.cost
                moved_tokens = self._engine(longest - matched)
                moved = cost.saved_s(self.n, self._engine(longest)) * self.weight - cost.transfer_s(
                    moved_tokens
                )
                self.moved_for[matched] = moved
            if moved > saved:
                saved, matched = moved, longest
        if self.unit != 1.0:
            backlog *= self.unit
        # T_queue, inlined from CostModel.queue_s (kept equal by a test). The backlog alone bounds
        # the score from above: skip the rest when even that cannot reach a tie.
        if saved - self.backlog_s_per_token * backlog < self.best_score - self.reach:
            return
        q = self.q
        n = self.n
        # The backlog's attention (`CostModel.queue_s`): its prompts' own, drained with the tokens
        # (`prefill_progress`; the share discounts tokens, not pairs), at least the mean prompt's.
        whole = view.in_flight_prefill_tokens
        pairs: float = view.in_flight_prefill_pairs if whole > 0 else 0
        if pairs:
            pending = self.pending
            if pending is not None and pending[i] < whole:
                pairs *= pending[i] / whole
            if self.unit != 1.0:
                pairs *= self.unit * self.unit
        floor = backlog * q.mean_prompt_tokens / 2
        if pairs < floor:
            pairs = floor
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
                if known > 0 and whole > 0:
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
        ahead = 0.0
        if backlog > 0:
            ahead = q.prefill_per_token_s * backlog + q.attention_per_pair_s * pairs
            ahead += q.step_s * -(-int(backlog) // budget)
            queue += ahead
        queue *= q.scale
        score = saved - queue
        if self.price is not None:
            score -= self.price.charge(view, matched, backlog, ahead * q.scale, running, queue)
        if view.warming or (self.adapter and view.loaded_adapters is not None):
            score -= self.cost.cold_s(view, self.adapter)
        if self.recent is not None and (found := self.recent.get(view.worker_id)) is not None:
            work, at_s = found
            score -= self.branch_s * (work * math.exp(-max(0.0, self.now_s - at_s) / self.window_s))
        near = self.near
        if near is not None and score >= self.best_score - self.reach:
            near.append((score, i, matched, queue))
        if score > self.best_score + self.tie:
            self.best_score, self.best = score, [(i, matched, queue)]
        elif score >= self.best_score - self.tie:
            if score > self.best_score:
                self.best_score = score
            self.best.append((i, matched, queue))
