"""Per-pool engine-time model: how long a prefill, a queue, a KV transfer or a cold start takes.

The step model follows shared/reference/engine-timing.md §6: one engine step costs
`a + b·tokens + c·requests + d·context_tokens`, and a prefill chunk adds causal attention
`e·m·(p + m/2)` (m new tokens over p already in KV). Prefill of `new` tokens over `ctx` cached ones:

    T_prefill(new, ctx) = s · (b·new + e·new·(ctx + new/2) + a·ceil(new / budget))

A worker's prefill queue is priced the same way over the prompts pending there: `b` per token of
the backlog plus `e` per attention pair of its prompts (`WorkerView.in_flight_prefill_pairs`, never
below the mean prompt's `tokens · mean / 2`), so a queued 190k-token miss weighs as the 28 s of
compute it is, not as 190k tokens of mean-sized prompts.

The scale `s` starts at 1 and is calibrated online from observed TTFT minus the queueing we
predicted at dispatch, against the prefill we predicted for the reported `cached_tokens`.

The constants and the named engine profiles live in `cost_params.py`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from policies.base import RouteRequest, WorkerId, WorkerView, reported_load
from policies.cost_params import CostModelParams, transfer_time_s
from policies.records import record


@record
class QueueTerms:
    """The constants of `CostModel.queue_s` at this moment, for callers that inline it (rebuilt
    whenever a completion moves the scale or the mean prompt: a record, cheap to build)."""

    scale: float
    max_batched_tokens: int
    step_s: float
    backlog_per_token_s: float  # b + e · mean prompt / 2: a backlog token at the least attention
    prefill_per_token_s: float
    attention_per_pair_s: float
    per_request_s: float
    per_context_token_s: float
    mean_prompt_tokens: float


@record
class CalibrationSample:
    """What one completion teaches the calibration: the engine's prompt tokens (0: unknown), the
    request's own estimate of them (0: none) and observed over predicted prefill time (0: no
    measurement). Numbers only, so replica sync can share it (`policies.peer_sync`)."""

    prompt_tokens: int
    request_tokens: int
    scale_ratio: float


@record
class _Pending:
    worker: WorkerId  # the worker whose queue `queue_s` predicts: only its leg's outcome is folded
    queue_s: float
    matched_tokens: int


class CostModel:
    """One pool's cost model with its online calibration state."""

    MAX_PENDING = 65_536

    def __init__(self, params: CostModelParams) -> None:
        self.params = params
        self._log_scale = 0.0
        self.scale = 1.0
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._mean_prompt_tokens = 1024.0
        self.calibration_samples = 0
        self._terms: QueueTerms | None = None
        # Engine tokens per request token: 1 when keys are token-exact; about chars_per_token ×
        # the engine's tokens per character in approximate mode. Learned from usage.prompt_tokens.
        self.engine_tokens_per_request_token = 1.0
        self._log_unit = 0.0
        self._unit_samples = 0

    # -- time estimates -----------------------------------------------------------------------

    def prefill_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        p = self.params
        steps = -(-new_tokens // p.max_batched_tokens)
        raw = (
            p.prefill_s_per_token * new_tokens
            + p.attention_s_per_pair * new_tokens * (context_tokens + new_tokens / 2)
            + p.step_s * steps
        )
        return self.scale * raw

    def saved_s(self, prompt_tokens: int, matched_tokens: int) -> float:
        """Prefill time a match of `matched_tokens` saves on a `prompt_tokens` prompt."""
        m = min(matched_tokens, prompt_tokens)
        if m <= 0:
            return 0.0
        # T_prefill(n, 0) − T_prefill(n − m, m): the attention terms differ by exactly e·m²/2.
        p = self.params
        budget = p.max_batched_tokens
        steps = -(-prompt_tokens // budget) - -(-(prompt_tokens - m) // budget)
        raw = p.prefill_s_per_token * m + p.attention_s_per_pair * m * m / 2 + p.step_s * steps
        return self.scale * raw

    def decode_step_s(self, running_requests: int, context_tokens: int) -> float:
        p = self.params
        per_step = p.step_s + p.decode_s_per_request * running_requests
        return self.scale * (per_step + p.decode_s_per_context_token * context_tokens)

    def joined_decode_step_s(self, view: WorkerView, load: int, req: RouteRequest) -> float:
        """The decode step of `view`'s batch once `req` joins it, `decode_step_s(requests + 1,
        context)`: what `cost`'s `keep_tpot_s` bounds for a holder past the load guard. The context
        is what the worker decodes now (`decode_context_tokens`), the prompts queued for its prefill
        (they decode before this request does) and the request's own context at mid-decode."""
        out = req.max_output_tokens or 0
        context = view.decode_context_tokens + view.in_flight_prefill_tokens + req.n_prompt_tokens + out // 2
        return self.decode_step_s(load + 1, int(context * self.engine_tokens_per_request_token))

    def queue_s(
        self, view: WorkerView, new_tokens: int = 0, uncached_share: float = 1.0, now_s: float | None = None
    ) -> float:
        """Work ahead of a new request on `view`, plus the decode interference its own prefill suffers.

        Prefill backlog is the gateway's in-flight prefill tokens (less the progress made on them
        by `now_s`, see `prefill_remaining`; none without `now_s`) times `uncached_share` (the share
        of them the worker must still compute), plus the causal attention of those prompts
        (`WorkerView.in_flight_prefill_pairs`, drained in proportion), never counted below the
        mean prompt's per backlog token. When the worker reports more requests than this gateway
        sent (other gateway replicas, other clients), the backlog is scaled up by the ratio, and
        the tokens added are of prompts of the mean size.
        """
        p = self.params
        whole = view.in_flight_prefill_tokens
        pending = whole if now_s is None else self.prefill_remaining(view, now_s)
        backlog = pending * uncached_share
        pairs = view.in_flight_prefill_pairs * (pending / whole) if whole > 0 else 0.0
        pairs = max(pairs, backlog * self._mean_prompt_tokens / 2)
        known = view.in_flight_requests
        running = known
        scraped = reported_load(view)
        if scraped is not None:
            waiting, scraped_running = scraped
            reported = waiting + scraped_running
            if reported > known:
                mean = self._mean_prompt_tokens
                if known > 0 and whole > 0:
                    # The requests it did not send bring as many tokens each as its own, of
                    # prompts of the mean size.
                    extra = backlog * (reported / known - 1)
                    backlog += extra
                    pairs += extra * mean / 2
                else:
                    backlog += waiting * mean
                    pairs += waiting * mean * mean / 2
            if scraped_running > running:
                running = scraped_running
        steps = -(-int(backlog + new_tokens) // p.max_batched_tokens)
        per_step = (
            p.decode_s_per_request * running + p.decode_s_per_context_token * view.in_flight_decode_tokens
        )
        if backlog <= 0:
            return self.scale * steps * per_step
        backlog_steps = -(-int(backlog) // p.max_batched_tokens)
        prefill = p.prefill_s_per_token * backlog + p.attention_s_per_pair * pairs
        return self.scale * (prefill + p.step_s * backlog_steps + steps * per_step)

    def prefill_remaining(self, view: WorkerView, now_s: float) -> int:
        """Request tokens of `view`'s prefill backlog still to compute at `now_s` (the whole
        backlog with `prefill_progress` 0).

        The gateway counts a prompt as pending, whole, until its first token. Since
        `view.prefill_started_s` the engine's prefill has gone to no other prompts than the ones
        pending now, so at most the elapsed time's worth of them is done: the backlog drains as a
        fluid at `prefill_progress` × the calibrated prefill rate, never below zero. The rate is
        the slowest the backlog can have: attention as if it were one prompt (or a mean one, if
        larger), so a long prompt near its end is seen near its end, and several short ones drain
        no faster than they can be computed. The share stands for what the model does not see:
        the steps the engine gives to decodes, whose context the gateway does not count, and the
        wait for a step's end before a first token shows.
        """
        pending = view.in_flight_prefill_tokens
        started = view.prefill_started_s
        if started is None or pending <= 0 or self.params.prefill_progress <= 0:
            return pending
        return self.prefill_left((pending,), (started,), self.step_s_per_token((view,)), now_s)[0]

    def step_s_per_token(self, views: Iterable[WorkerView]) -> list[float]:
        """What the engine's steps add to each token of each view's prefill backlog: every step of
        `max_batched_tokens` also pays its overhead and the decodes it carries. It depends on the
        view alone, so a caller that drains the same views again keeps it (`prefill_left`)."""
        p = self.params
        a, c, d, budget = p.step_s, p.decode_s_per_request, p.decode_s_per_context_token, p.max_batched_tokens
        return [(a + c * w.in_flight_requests + d * w.in_flight_decode_tokens) / budget for w in views]

    def prefill_left(
        self,
        pending: Sequence[int],
        started_s: Sequence[float],
        step_s_per_token: Sequence[float],
        now_s: float,
    ) -> list[int]:
        """`prefill_remaining` at `now_s` of many backlogs in one pass (this is its formula): each of
        `pending` tokens (> 0), its work restarted at `started_s`, its view's `step_s_per_token`.

        One expression a backlog, without a call: a pool of a thousand busy workers drains all of
        them at every decision (`policies.cost_scan.CandidateCache`)."""
        p = self.params
        progress = p.prefill_progress
        if progress <= 0:
            return list(pending)
        unit = self.engine_tokens_per_request_token
        mean = self._mean_prompt_tokens
        scale = self.scale
        per_token = p.prefill_s_per_token
        per_pair = p.attention_s_per_pair
        # Per backlog (`for v in [...]` is an assignment in a comprehension): seconds a token =
        # b + e · max(prompt, mean) / 2 + the steps' share; done by `now_s`: progress × elapsed /
        # (scale · seconds a token · unit), none before the start, at most all that is pending.
        return [
            0 if done >= x else x - done if done > 0 else x
            for x, s, y in zip(pending, started_s, step_s_per_token, strict=True)
            for xu in [x * unit]
            for prompt in [xu if xu > mean else mean]
            for done in [
                int(progress * (now_s - s) / (scale * (per_token + per_pair * prompt / 2 + y) * unit))
            ]
        ]

    def remaining_at(self, now_s: float) -> Drain | None:
        """`prefill_remaining` at `now_s`, for one view or many (`Drain`); None with
        `prefill_progress` 0 (every backlog is whole)."""
        if self.params.prefill_progress <= 0:
            return None
        return Drain(self, now_s)

    @property
    def mean_prompt_tokens(self) -> float:
        """Running mean of completed prompts' sizes (seeded at 1024)."""
        return self._mean_prompt_tokens

    def queue_terms(self) -> QueueTerms:
        """The current constants (cached; rebuilt after a completion moves the scale or the mean)."""
        terms = self._terms
        if terms is None or terms.scale != self.scale or terms.mean_prompt_tokens != self._mean_prompt_tokens:
            terms = self._terms = self._build_terms()
        return terms

    def _build_terms(self) -> QueueTerms:
        p = self.params
        return QueueTerms(
            scale=self.scale,
            max_batched_tokens=p.max_batched_tokens,
            step_s=p.step_s,
            backlog_per_token_s=p.prefill_s_per_token + p.attention_s_per_pair * self._mean_prompt_tokens / 2,
            prefill_per_token_s=p.prefill_s_per_token,
            attention_per_pair_s=p.attention_s_per_pair,
            per_request_s=p.decode_s_per_request,
            per_context_token_s=p.decode_s_per_context_token,
            mean_prompt_tokens=self._mean_prompt_tokens,
        )

    def transfer_s(self, tokens: int) -> float:
        """Moving `tokens` of KV from another holder; `inf` when the pool cannot move KV."""
        p = self.params
        if not p.transfer_enabled:
            return math.inf
        return transfer_time_s(
            tokens, p.transfer_setup_s, p.transfer_bytes_per_token, p.transfer_bandwidth_bytes_per_s
        )

    def cold_s(self, view: WorkerView, adapter: str | None) -> float:
        cold = self.params.warming_s if view.warming else 0.0
        if adapter and view.loaded_adapters is not None and adapter not in view.loaded_adapters:
            cold += self.params.cold_adapter_s
        return cold

    # -- calibration --------------------------------------------------------------------------

    def note_dispatch(self, request_id: str, worker: WorkerId, queue_s: float, matched_tokens: int) -> None:
        """Keep what the model predicted for `request_id` on `worker`, for its outcome there to
        calibrate against. One record a request: a later note (a P/D pair's leg that gives the
        first token) replaces it."""
        pending = self._pending
        pending[request_id] = _Pending(worker, queue_s, matched_tokens)
        if len(pending) > self.MAX_PENDING:
            pending.popitem(last=False)

    def predicted_queue_s(self, request_id: str, worker: WorkerId) -> float | None:
        """The queue `note_dispatch` kept for `request_id` on `worker` (None: none kept there)."""
        pending = self._pending.get(request_id)
        return None if pending is None or pending.worker != worker else pending.queue_s

    def _take(self, request_id: str, worker: WorkerId) -> _Pending | None:
        """The request's record if it predicts `worker`, removed; another worker's leg of the same
        request (P/D) leaves it for the leg it is about."""
        pending = self._pending.get(request_id)
        if pending is None or pending.worker != worker:
            return None
        del self._pending[request_id]
        return pending

    def forget(self, request_id: str, worker: WorkerId) -> None:
        """Drop the calibration record of a request `worker` did not serve (nothing to learn)."""
        self._take(request_id, worker)

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    def note_complete(
        self,
        request_id: str,
        worker: WorkerId,
        ttft_s: float | None,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        request_tokens: int | None = None,
    ) -> CalibrationSample | None:
        """Fold one completion into the calibration (`fold`) and return what it taught, for
        replica sync to share (None: nothing)."""
        sample = self.sample(
            self._take(request_id, worker), ttft_s, prompt_tokens, cached_tokens, request_tokens
        )
        if sample is not None:
            self.fold(sample)
        return sample

    def sample(
        self,
        pending: _Pending | None,
        ttft_s: float | None,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        request_tokens: int | None,
    ) -> CalibrationSample | None:
        """What one completion says: the engine's prompt size (and the request's estimate of it)
        and, when enough was computed, observed over predicted prefill time (clipped)."""
        prompt = prompt_tokens if prompt_tokens is not None and prompt_tokens > 0 else 0
        estimate = request_tokens if request_tokens and request_tokens > 0 and prompt else 0
        ratio = 0.0
        p = self.params
        if p.calibrate and pending is not None and ttft_s is not None and prompt:
            cached = pending.matched_tokens if cached_tokens is None else min(cached_tokens, prompt)
            new = prompt - cached
            if new >= 64:  # less is too little compute to say anything about the per-token rate
                predicted = self.prefill_s(new, cached) / self.scale
                observed = ttft_s - p.ingestion_s - pending.queue_s
                if predicted > 0 and observed > 0:
                    ratio = observed / predicted  # clipped as in `fold`
                    ratio = p.min_scale if p.min_scale > ratio else ratio
                    ratio = p.max_scale if p.max_scale < ratio else ratio
        if not prompt and not ratio:
            return None
        return CalibrationSample(prompt, estimate, ratio)

    def fold(self, sample: CalibrationSample) -> None:
        """Fold a sample, this gateway's or a peer's, into the scale (log-domain EWMA, clipped to
        the configured range), the mean prompt, and the engine's prompt size against the request's
        estimate into `engine_tokens_per_request_token`."""
        # `min(max(x, lo), hi)` is written as conditionals that pick what the builtins pick (NaN
        # included): this runs at every completion, and a builtin call costs more than the test.
        prompt = sample.prompt_tokens
        if sample.request_tokens > 0 and prompt > 0:
            ratio = prompt / sample.request_tokens
            ratio = 0.05 if ratio < 0.05 else ratio
            ratio = 20.0 if ratio > 20.0 else ratio
            # The first sample sets the unit outright: until it does, every token count the policy
            # weighs against the engine's (the mean prompt, the calibrated rates) is off by it.
            weight = 0.05 if self._unit_samples else 1.0
            self._unit_samples += 1
            self._log_unit += weight * (math.log(ratio) - self._log_unit)
            # Snap to exactly 1 when keys are token-exact, so that path stays integer arithmetic.
            unit = math.exp(self._log_unit)
            self.engine_tokens_per_request_token = 1.0 if abs(unit - 1.0) < 1e-3 else unit
        if prompt > 0:
            self._mean_prompt_tokens += 0.01 * (prompt - self._mean_prompt_tokens)
        p = self.params
        if not p.calibrate or sample.scale_ratio <= 0:
            return
        lo, hi = p.min_scale, p.max_scale
        ratio = sample.scale_ratio
        ratio = lo if lo > ratio else ratio
        ratio = hi if hi < ratio else ratio
        self._log_scale += p.calibration_weight * (math.log(ratio) - self._log_scale)
        scale = math.exp(self._log_scale)
        scale = lo if lo > scale else scale
        self.scale = hi if hi < scale else scale
        self.calibration_samples += 1


@record
class Drain:
    """`CostModel.prefill_remaining` at one instant (`CostModel.remaining_at`): called on a view,
    or over columns of backlogs (`left`) by a caller that keeps each view's `step_s_per_token`."""

    model: CostModel
    now_s: float

    def __call__(self, view: WorkerView) -> int:
        return self.model.prefill_remaining(view, self.now_s)

    def left(
        self, pending: Sequence[int], started_s: Sequence[float], step_s_per_token: Sequence[float]
    ) -> list[int]:
        """`CostModel.prefill_left` at this instant."""
        return self.model.prefill_left(pending, started_s, step_s_per_token, self.now_s)
