"""What `cost` keeps of what it and its peers routed, for its score: the requests in flight and
their predicted uncached share (`InflightLedger`), the prefill work routed to each worker, decayed
over `load_window_s` (`RecentWork`), and, while the decode price is on, each request's output
budget and predicted first token (`DecodeLedger`). Handed on across a policy reload
(`carry_over`) and let go of when replaced (`retire`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from policies.base import Observation, RouteDecision, RouteRequest, WorkerId
from policies.cost_decode import DecodeLedger
from policies.cost_herd import HerdingPolicy
from policies.cost_ledger import InflightLedger, RecentWork
from policies.cost_turns import TurnChains
from policies.peer_sync import PeerHolding
from policies.pools import PoolState
from policies.prefix_policy import SharedSettings


class CostBooks(HerdingPolicy):
    """The bookkeeping half of `CostPolicy` (`cost_policy`). `discount_cached_backlog` and
    `records_decodes` are the scoring half's settings: how backlogs are counted, and whether
    the decode price needs each request's first token."""

    def __init__(self, *, seed: int, shared: SharedSettings | None, load_window_s: float) -> None:
        super().__init__(seed=seed, shared=shared)
        self.load_window_s = load_window_s
        self.discount_cached_backlog: bool | Literal["holders"] | None = None
        self.records_decodes = False
        self._moves_kv: set[str] = set()
        self._recent_work = RecentWork(load_window_s)
        self._ledger = InflightLedger()
        self._decodes = DecodeLedger()
        # Set by `cost` when `stay_waited_within_s` is: which turns were sent without waiting.
        self._turns: TurnChains | None = None

    def carry_over(self, previous: object, pools: Collection[str]) -> list[str]:
        """`PrefixPolicyBase.carry_over`, and from a `cost` policy its recent routing: the
        requests in flight (their outcomes take them out of this policy's ledger now) and the
        prefill work routed to each worker (decayed from now on over this policy's
        `load_window_s`). Without them the first decisions after a reload would see every worker
        as idle of the work this gateway just sent it."""
        kept = super().carry_over(previous, pools)
        if isinstance(previous, CostBooks):
            self._ledger = previous._ledger
            self._recent_work = previous._recent_work
            self._recent_work.window_s = self.load_window_s
            self._decodes = previous._decodes
            if self._turns is not None and previous._turns is not None:
                self._turns = previous._turns
        return kept

    def retire(self) -> None:
        super().retire()
        self._recent_work = RecentWork(self.load_window_s)
        self._ledger = InflightLedger()
        self._decodes = DecodeLedger()
        if self._turns is not None:
            self._turns = TurnChains()

    def recent_work_s(self, worker: WorkerId, now_s: float) -> float:
        """Prefill seconds this policy routed to `worker`, exponentially decayed over `load_window_s`;
        the model's seconds, before calibration: the score multiplies them by the current scale."""
        return self._recent_work.at(worker, now_s)

    def uncached_share(self, worker: WorkerId) -> float:
        """Predicted uncached share of the prompts this policy has in flight on `worker` (1 if none)."""
        return self._ledger.share(worker)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        super().on_complete(obs, now_s)
        self._ledger.remove(obs.request.request_id, obs.worker)
        self._decodes.remove(obs.request.request_id, obs.worker)
        if self._turns is not None:
            self._turns.ended(obs.request.request_id, obs.worker)

    def _forget_load(self, pool: str, worker: WorkerId, gone: bool) -> None:
        # The in-flight ledger needs nothing: each of its requests leaves it when its outcome
        # comes, wherever it ran. A worker that joined or restarted starts at its pool's mean
        # recent work (`RecentWork.restart`); one that left is forgotten.
        if gone:
            self._recent_work.forget(worker)
        else:
            self._recent_work.restart(worker, self._pools.workers_of(pool))

    def _dispatched_to(
        self, pool: PoolState, req: RouteRequest, decision: RouteDecision, now_s: float
    ) -> None:
        matched = min(decision.matched_tokens, req.n_prompt_tokens)
        self._ledger.add(req.request_id, decision.worker, req.n_prompt_tokens, req.n_prompt_tokens - matched)
        if self._turns is not None:
            self._turns.dispatched(req.request_id, decision.worker, req.block_keys)
        self._add_work(pool, decision.worker, req.n_prompt_tokens, matched, now_s)
        if self.records_decodes:
            # Its first token is predicted where the decision predicted its queue and prefill.
            cost = pool.cost
            unit = cost.engine_tokens_per_request_token
            m = int(matched * unit)
            queue_s = cost.predicted_queue_s(req.request_id, decision.worker) or 0.0
            first_s = now_s + queue_s + cost.prefill_s(int(req.n_prompt_tokens * unit) - m, m)
            self._decodes.add(req.request_id, decision.worker, req.max_output_tokens, first_s)

    def _apply_peer_holding(self, pool: PoolState, holding: PeerHolding, now_s: float) -> None:
        # A peer's dispatch is work routed to that worker as much as our own is.
        super()._apply_peer_holding(pool, holding, now_s)
        matched = min(holding.matched_tokens, holding.n_prompt_tokens)
        self._add_work(pool, holding.worker, holding.n_prompt_tokens, matched, now_s)

    def _add_work(self, pool: PoolState, worker: WorkerId, prompt: int, matched: int, now_s: float) -> None:
        # `prompt` and `matched` are request tokens; the prefill time is the engine's. Stored
        # before calibration, so that the charge moves with the scale as the other terms do: the
        # choice then does not depend on the scale's history (how it stood at each dispatch).
        cost = pool.cost
        unit = cost.engine_tokens_per_request_token
        work = cost.prefill_s(int((prompt - matched) * unit), int(matched * unit)) / cost.scale
        self._recent_work.add(worker, work, now_s)

    def pool_moves_kv(self, pool: str) -> None:
        """`pool`'s workers move KV between them (`pd.mode: holder_prefill`), so a session kept
        with its holder need not decode there: with `discount_cached_backlog` unset, its
        workers' backlogs count the tokens left to compute. Counted as whole prompts, a holder
        busy with mostly-cached turns looks seconds away and long histories are recomputed
        elsewhere; counted as what is left, sessions stay with their holders, which alone would
        pile their decodes up there (docs/policy.md, docs/benchmarks.md "Holder prefill")."""
        self._moves_kv.add(pool)

    def discounts_backlog(self, pool: str) -> bool:
        """Whether `pool`'s prefill backlogs are all counted in uncached tokens: set true, or
        unset or `holders` in a pool whose workers move KV (which counts every one so)."""
        setting = self.discount_cached_backlog
        return pool in self._moves_kv if setting in (None, "holders") else setting is True

    def discounts_holders(self, pool: str) -> bool:
        """Whether only the backlogs of the holders of most of a prompt are counted in uncached
        tokens, when scored for that prompt (`discount_cached_backlog: holders`, in a pool whose
        workers do not move KV)."""
        return self.discount_cached_backlog == "holders" and pool not in self._moves_kv

    def backlog_share(self, pool: str, worker: WorkerId) -> float:
        """The share of `worker`'s in-flight prefill tokens this policy counts as work ahead of a
        new request: its predicted uncached share where backlogs are so counted, else 1."""
        return self._ledger.share(worker) if self.discounts_backlog(pool) else 1.0
