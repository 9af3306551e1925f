"""Prefill/decode disaggregation: choose a request's prefill and decode workers together.

In a P/D pool a route is a pair: the prefill worker P computes the prompt, its KV moves to the
decode worker D, and D streams the answer. Every option is scored in seconds against one baseline,
a full prefill of the prompt on an idle worker, so options compare directly (higher is better):

    split(P, D) = prefill(P) − T_transfer(n − held_D) − T_decode(D) − T_kv(D)
    alone(D)    = saved(held_D) − T_queue(D) − T_cold(D) − interference(D) − T_decode(D) − T_kv(D)

- prefill(P) = saved(matched_P) − T_queue(P) − T_cold(P): the design's score, where P is what the
  routing policy picks among the prefill-capable workers (`cost` ranks them by this very score; a
  baseline by its own rule, which is what a comparison of prefill choices needs).
- T_transfer = setup + tokens · bytes_per_token / bandwidth, for the prompt tokens D does not hold
  (a decode worker reads only what its own prefix cache lacks).
- T_decode(D) = output tokens × one decode step at D's batch after admitting this request: D's
  decode load, the time the answer takes there.
- T_kv(D): a large fixed penalty when D's free KV (reported usage × capacity) cannot hold the
  request (it would wait for room or preempt): such a worker is chosen only when all are full.
- alone(D) is conditional disaggregation: D computes what it lacks itself. A decode worker that
  prefills stalls the requests it is decoding, so each of them (at least one) is charged the
  prefill's compute (`interference_weight` per request). A prompt that is mostly cached on D
  costs little there, and then skipping the split finishes sooner.

In `holder_prefill` mode (a pool of mixed vLLM workers, every one able to send and receive KV) a
request runs where the routing policy sends it, alone, unless another worker H holds more of its
prompt than the policy's pick W, and over `holder_share` of it: then H prefills (only what it
lacks) and the best decode worker D ≠ H decodes, when that scores better:

    split(H, D) = prefill(H) − T_transfer(n − held_D) − T_decode(D) − T_kv(D)
    alone(W)    = prefill(W) − T_decode(W)

This is for the sessions a policy moves off the holder of their history because its decodes are
many (`cost`'s bounded-load guard): without it they are recomputed elsewhere in full; with it
the holder computes the new turn and the decodes move, so the next turn's holder is a lighter
worker.

The cost terms come from the policy's per-pool `CostModel` (the same model, calibrated online,
that `cost` routes with); a policy that keeps no index supplies neither holdings nor a calibrated
model, and the router falls back to zero holdings and the default constants.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast, runtime_checkable

from policies.base import Role, RouteDecision, RouteRequest, RoutingPolicy, WorkerId, WorkerView
from policies.cost_model import CostModel
from policies.cost_params import CostModelParams, transfer_time_s
from policies.pd_scorer import PdScorer
from policies.pools import available
from policies.records import record

SPLIT = "pd_split"
# Why a request ran on one worker alone (the gateway counts these as skipped splits).
ALONE_SOONER = "pd_alone_sooner"  # conditional disaggregation: it finishes sooner alone
ALONE_NO_PAIR = "pd_alone_no_pair"  # no prefill worker, or no decode worker besides it, could take it
ALONE_UNSPLITTABLE = "pd_alone_unsplittable"  # the request cannot be split (several sequences)
WHOLE = "pd_whole"  # the route does not generate (embeddings, scores, tokenizer, ...): never split
HOLDER_HIT = "hit"  # holder_prefill: the prefill leg's reason (the holder of the longest match)
ALONE_POLICY = "pd_alone_policy"  # holder_prefill: no other worker holds more of it than the policy's pick
PdMode = Literal["pairs", "holder_prefill"]
PAIRS: PdMode = "pairs"  # every option scored (the module docstring's two formulas)
HOLDER_PREFILL: PdMode = "holder_prefill"  # the policy's pick, or a split from the prompt's holder


@record
class PdRoles:
    """Which worker roles may play each part under a wire protocol: `alone`, a generation
    request run without a split; `whole`, a request of a route that does not generate."""

    prefill: frozenset[Role]
    decode: frozenset[Role]
    alone: frozenset[Role]
    whole: frozenset[Role]


# vLLM's connector acts per request on every server (`kv_both`): a mixed worker may play either
# half, and a decode worker also serves a plain request, generation or not.
VLLM_ROLES = PdRoles(
    prefill=frozenset({Role.PREFILL, Role.MIXED}),
    decode=frozenset({Role.DECODE, Role.MIXED}),
    alone=frozenset({Role.DECODE, Role.MIXED}),
    whole=frozenset({Role.DECODE, Role.MIXED}),
)
# SGLang's prefill and decode servers take generation requests only as a pair (one without a
# bootstrap room is refused); a mixed server ignores the bootstrap fields, so it never takes part
# in a split and serves whole requests only. A request of another route goes to a mixed server,
# or with none free to a prefill server: a decode server only admits KV another server computed.
SGLANG_ROLES = PdRoles(
    prefill=frozenset({Role.PREFILL}),
    decode=frozenset({Role.DECODE}),
    alone=frozenset({Role.MIXED}),
    whole=frozenset({Role.MIXED, Role.PREFILL}),
)


@dataclass(frozen=True, slots=True)
class PdSettings:
    """A P/D pool's routing constants (seconds, tokens, bytes)."""

    roles: PdRoles = VLLM_ROLES
    transfer_setup_s: float = 0.001
    transfer_bytes_per_token: int = 131_072
    transfer_bandwidth_bytes_per_s: float = 45e9
    conditional: bool = True
    interference_weight: float = 1.0
    default_output_tokens: int = 256
    kv_full_penalty_s: float = 30.0
    tie_s: float = 1e-4
    mode: PdMode = PAIRS
    holder_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.holder_share < 1:
            raise ValueError("holder_share must be in [0, 1)")
        if self.transfer_bandwidth_bytes_per_s <= 0 or self.transfer_bytes_per_token <= 0:
            raise ValueError("transfer bandwidth and bytes per token must be > 0")
        if min(self.transfer_setup_s, self.interference_weight, self.kv_full_penalty_s, self.tie_s) < 0:
            raise ValueError(
                "transfer_setup_s, interference_weight, kv_full_penalty_s and tie_s must be >= 0"
            )
        if self.default_output_tokens < 1:
            raise ValueError("default_output_tokens must be >= 1")

    def transfer_s(self, tokens: int) -> float:
        """T_transfer of `tokens` prompt tokens from the prefill worker to the decode worker."""
        return transfer_time_s(
            tokens, self.transfer_setup_s, self.transfer_bytes_per_token, self.transfer_bandwidth_bytes_per_s
        )


@record
class PdDecision:
    """A P/D route: the prefill half (None when the decode worker runs the request alone), the
    decode half, the option's score in seconds and a metrics-safe reason.

    `transfer_tokens` is what the decode worker is expected to read from the prefill worker.
    The decode half's `matched_tokens` is what it will hold before computing anything: the whole
    prompt after a transfer, its own cached prefix when alone.
    """

    prefill: RouteDecision | None
    decode: RouteDecision
    score_s: float
    reason: str
    transfer_tokens: int = 0

    @property
    def skip_prefill(self) -> bool:
        return self.prefill is None


@runtime_checkable
class PrefixHolder(Protocol):
    """What a prefix-aware policy tells P/D routing: each worker's cached prompt tokens and the
    pool's cost model (`policies.prefix_policy.PrefixPolicyBase` has both)."""

    def held_tokens(
        self, req: RouteRequest, shared_prefix_blocks: int, now_s: float
    ) -> Mapping[WorkerId, int]:
        """Prompt tokens each worker holds for `req`."""
        ...

    def cost_model(self, req: RouteRequest) -> CostModel:
        """The request's pool's cost model."""
        ...


@runtime_checkable
class MovesKvAware(Protocol):
    """A policy that scores pools whose workers move KV differently (`CostPolicy.pool_moves_kv`)."""

    def pool_moves_kv(self, pool: str) -> None:
        """Told at each `holder_prefill` decision of `pool` (idempotent, a set insert)."""
        ...

    def backlog_share(self, pool: str, worker: WorkerId) -> float:
        """The share of `worker`'s in-flight prefill tokens the policy counts as work ahead (1:
        whole prompts), so that the split it is offered is scored as its own pick was."""
        ...


@record
class _Option:
    score_s: float
    decode: WorkerView
    held: int  # engine tokens the decode worker holds
    split: bool


class PdRouter:
    """Chooses P/D pairs (see the module docstring). Pure: time comes in as `now_s`, and the only
    state is the tie-breaking random generator."""

    def __init__(self, settings: PdSettings, *, seed: int = 0) -> None:
        self.settings = settings
        self._rng = random.Random(seed)
        self._default_cost = CostModel(CostModelParams())
        # Whether each policy class answers P/D questions, and hears of pools that move KV: a
        # runtime Protocol check walks the protocol's attributes, too slow to repeat at every
        # decision.
        self._implements: dict[tuple[type, type], bool] = {}

    def select(
        self,
        policy: RoutingPolicy,
        req: RouteRequest,
        workers: Sequence[WorkerView],
        now_s: float,
        *,
        splittable: bool = True,
        whole: bool = False,
        holder: PrefixHolder | None = None,
    ) -> PdDecision | None:
        """The best pair or lone worker for `req` among `workers` (all of the pool's, healthy or
        not); None if no worker can serve it. `policy` picks the prefill worker; `holder` (by
        default the policy, when it keeps an index) says what each worker holds. A `whole`
        request (a route that does not generate) is never split: it goes to a worker that serves
        generation alone, or with none free to another of `PdRoles.whole`. The decision is not
        yet dispatched: the caller tells the policy of each half it sends."""
        s = self.settings
        if holder is None and self._is(policy, PrefixHolder):
            holder = cast(PrefixHolder, policy)
        ok = available(workers)
        splittable = splittable and not whole
        if s.mode == HOLDER_PREFILL:
            return self._holder_prefill(policy, req, workers, ok, now_s, splittable, whole, holder)
        prefill = self._prefill(policy, req, workers, ok, now_s) if splittable else None
        cost = holder.cost_model(req) if holder is not None else self._default_cost
        shared = prefill[0].shared_prefix_blocks if prefill is not None else 0
        held = holder.held_tokens(req, shared, now_s) if holder is not None else {}
        scorer = PdScorer(s, cost, req)
        options: list[_Option] = []
        if prefill is not None:
            decision, view = prefill
            prefill_s = scorer.prefill_s(view, scorer.engine(decision.matched_tokens))
            for d in ok:
                if d.role in s.roles.decode and d.worker_id != decision.worker:
                    h = scorer.engine(held.get(d.worker_id, 0))
                    options.append(_Option(prefill_s + scorer.split_s(d, h), d, h, True))
        split_possible = bool(options)
        if s.conditional or not split_possible:
            alone = s.roles.alone
            if whole and not any(d.role in alone for d in ok):
                alone = s.roles.whole  # SGLang: a prefill server when no mixed one is free
            for d in ok:
                if d.role in alone:
                    h = scorer.engine(held.get(d.worker_id, 0))
                    options.append(_Option(scorer.alone_s(d, h), d, h, False))
        if not options:
            return None
        top = max(o.score_s for o in options)
        best = [o for o in options if o.score_s >= top - s.tie_s]
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        if whole:
            reason = WHOLE
        elif not chosen.split:
            reason = ALONE_SOONER if split_possible else ALONE_NO_PAIR if splittable else ALONE_UNSPLITTABLE
        else:
            reason = SPLIT
        return self._decision(req, prefill[0] if prefill else None, chosen, cost, scorer, reason)

    def _is(self, policy: RoutingPolicy, protocol: type) -> bool:
        key = (type(policy), protocol)
        known = self._implements.get(key)
        if known is None:
            known = self._implements[key] = isinstance(policy, protocol)
        return known

    def _holder_prefill(
        self,
        policy: RoutingPolicy,
        req: RouteRequest,
        workers: Sequence[WorkerView],
        ok: Sequence[WorkerView],
        now_s: float,
        splittable: bool,
        whole: bool,
        holder: PrefixHolder | None,
    ) -> PdDecision | None:
        """`holder_prefill` mode (module docstring): the policy's pick alone, or a split from the
        worker that holds the most of the prompt when the pick holds less."""
        s = self.settings
        aware = cast(MovesKvAware, policy) if self._is(policy, MovesKvAware) else None
        if aware is not None:
            aware.pool_moves_kv(req.pool)  # before its pick: it shapes the pick
        roles = s.roles.whole if whole else s.roles.alone
        pick = policy.select(req, [w for w in workers if w.role in roles], now_s)
        view = None if pick is None else next((w for w in ok if w.worker_id == pick.worker), None)
        if pick is None or view is None:
            return None
        if whole or not splittable:
            return PdDecision(None, pick, pick.score_s, WHOLE if whole else ALONE_UNSPLITTABLE)
        if holder is None:  # a policy that keeps no index: nobody is known to hold more
            return PdDecision(None, pick, pick.score_s, ALONE_POLICY)
        cost = holder.cost_model(req)
        scorer = PdScorer(s, cost, req)
        held = {
            w: scorer.engine(t) for w, t in holder.held_tokens(req, pick.shared_prefix_blocks, now_s).items()
        }
        prefill = [w for w in ok if w.role in s.roles.prefill]
        top = max(prefill, key=lambda w: held.get(w.worker_id, 0), default=None)
        top_held = 0 if top is None else held.get(top.worker_id, 0)
        picked = held.get(view.worker_id, 0)
        if top is None or top_held <= max(picked, s.holder_share * scorer.n):
            return PdDecision(None, pick, pick.score_s, ALONE_POLICY)

        def share(w: WorkerView) -> float:
            return 1.0 if aware is None else aware.backlog_share(req.pool, w.worker_id)

        alone_s = scorer.prefill_s(view, picked, share(view)) - scorer.decode_s(view)
        prefill_s = scorer.prefill_s(top, top_held, share(top))
        options: list[_Option] = []
        for d in ok:
            if d.role in s.roles.decode and d.worker_id != top.worker_id:
                h = held.get(d.worker_id, 0)
                options.append(_Option(prefill_s + scorer.split_s(d, h), d, h, True))
        best = max(options, key=lambda o: o.score_s, default=None)
        if best is None or best.score_s <= alone_s + s.tie_s:
            return PdDecision(None, pick, pick.score_s, ALONE_SOONER if best is not None else ALONE_NO_PAIR)
        first = RouteDecision(
            top.worker_id, prefill_s, HOLDER_HIT, scorer.request_tokens(top_held), pick.shared_prefix_blocks
        )
        # The policy noted its pick's predicted queue for calibration; the first leg runs on the holder.
        cost.note_dispatch(
            req.request_id, top.worker_id, cost.queue_s(top, scorer.n - top_held, share(top)), top_held
        )
        return self._decision(req, first, best, cost, scorer, SPLIT)

    def _prefill(
        self,
        policy: RoutingPolicy,
        req: RouteRequest,
        workers: Sequence[WorkerView],
        ok: Sequence[WorkerView],
        now_s: float,
    ) -> tuple[RouteDecision, WorkerView] | None:
        """The policy's pick among the prefill-capable workers, with its view."""
        candidates = [w for w in workers if w.role in self.settings.roles.prefill]
        decision = policy.select(req, candidates, now_s) if candidates else None
        if decision is None:
            return None
        view = next((w for w in ok if w.worker_id == decision.worker), None)
        return None if view is None else (decision, view)

    def _decision(
        self,
        req: RouteRequest,
        prefill: RouteDecision | None,
        chosen: _Option,
        cost: CostModel,
        scorer: PdScorer,
        reason: str,
    ) -> PdDecision:
        shared = prefill.shared_prefix_blocks if prefill is not None else 0
        worker = chosen.decode.worker_id
        if chosen.split:
            assert prefill is not None
            # After the transfer the decode worker holds the whole prompt: nothing left to compute.
            decode = RouteDecision(worker, chosen.score_s, reason, req.n_prompt_tokens, shared)
            moved = max(0, scorer.n - chosen.held)
            return PdDecision(prefill, decode, chosen.score_s, reason, moved)
        matched = scorer.request_tokens(chosen.held)
        decode = RouteDecision(worker, chosen.score_s, reason, matched, shared)
        # The policy noted the prefill worker's predicted queue for calibration; the request's first
        # token now comes from the decode worker, so calibrate against that one instead.
        cost.note_dispatch(
            req.request_id, worker, cost.queue_s(chosen.decode, scorer.n - chosen.held), chosen.held
        )
        return PdDecision(None, decode, chosen.score_s, reason)
