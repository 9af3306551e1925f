"""`cost`'s steps 4 and 5 (`policies.cost_policy`): behind a sync broker, while several gateways
decide at the same instant (`policies.herd`), prefer this gateway's home share of the workers
within a margin, and hold the expensive requests of a burst until the cheap ones are placed.

Both stay off without a sync sink, without a name on the bus, and while peers' dispatches this
gateway cannot see are rare (`HERD_MIN_UNSEEN`): a single gateway decides exactly as without them.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import RouteRequest, WorkerView
from policies.cost_ledger import RecentWork
from policies.cost_scorer import Scorer
from policies.herd import hold_for, home_choice
from policies.prefix_policy import PrefixPolicyBase
from prompt_normalizer.types import PUBLIC_NAMESPACE


class HerdingPolicy(PrefixPolicyBase):
    """The herd margin and holds of a policy that keeps the prefill seconds recently routed to
    each worker (`_recent_work`); its settings `herd_weight` and `herd_hold_steps`."""

    herd_weight: float
    herd_hold_steps: int
    _recent_work: RecentWork

    # Below this many unseen peer dispatches per decision (`policies.herd.UnseenPeers`), gateways
    # rarely decide together: no home preference. A steady stream at a realistic rate and a sync lag
    # of milliseconds stays far below it. Above the cap, more are not counted: a gateway with few
    # decisions of its own that meets one large burst of its peers' would otherwise let its home
    # workers' queues grow without bound.
    HERD_MIN_UNSEEN = 0.5
    HERD_MAX_UNSEEN = 8.0

    def _unseen_in_burst(self) -> float:
        """Peer dispatches one decision cannot see (`policies.herd.UnseenPeers`) while gateways
        decide together: 0 below `HERD_MIN_UNSEEN`, without sync, or without a name on the bus."""
        if self._sync_sink is None or not self._gateways.name:
            return 0.0
        unseen = self._unseen.per_decision
        return unseen if unseen >= self.HERD_MIN_UNSEEN else 0.0

    def herd_margin_s(self, scale: float) -> float:
        """How much worse than the best a home worker may score and still be chosen: the prefill
        seconds that the peer dispatches this gateway cannot see would add to the best worker if
        they all went there (`herd_weight` × unseen dispatches per decision × mean prefill per
        dispatch, with at most `HERD_MAX_UNSEEN` dispatches counted). 0 with no peers in sight, with
        `herd_weight` 0, or without a name on the bus (no share can be dealt)."""
        if self.herd_weight <= 0:
            return 0.0
        unseen = self._unseen_in_burst()
        return self.herd_weight * min(unseen, self.HERD_MAX_UNSEEN) * self._recent_work.mean_s * scale

    def hold_s(self, req: RouteRequest, now_s: float) -> float:
        """Seconds to hold `req` before deciding it (step 5 of the module docstring): in a burst,
        one sync lag (`policies.herd.hold_for`) per step its own predicted prefill reaches, after
        the longer of its own match and its public one (the public one is what a request wholly
        inside a promoted public prefix is served from: holding less is the safe side); 0 outside
        bursts or with `herd_hold_steps` 0. The index is only read."""
        if self.herd_hold_steps <= 0 or self._sync_sink is None or self._unseen_in_burst() <= 0:
            return 0.0
        pool = self._pool(req)
        mine = self._own_keys(req)
        blocks = pool.index.lookup(mine.keys, mine.namespace, now_s).longest_blocks
        if req.public_block_keys:
            public = pool.index.lookup(req.public_block_keys, PUBLIC_NAMESPACE, now_s)
            blocks = max(blocks, public.longest_blocks)
        n = req.n_prompt_tokens
        matched = min(blocks * req.block_size_tokens, self._cap_tokens(req, n))
        cost = pool.cost
        unit = cost.engine_tokens_per_request_token
        prefill_s = cost.prefill_s(int((n - matched) * unit), int(matched * unit))
        hold_s = hold_for(prefill_s, self._unseen.lag_s, self.herd_hold_steps)
        if hold_s > 0:
            self._count("herd_holds")
        return hold_s

    def _home_choice(
        self,
        scorer: Scorer,
        workers: Sequence[WorkerView],
        cands: Sequence[WorkerView],
        chosen: int,
        matched: int,
        herd_s: float,
        now_s: float,
    ) -> tuple[float, int, int, float] | None:
        """The best of this gateway's home workers (`policies.herd`) among the candidates matching
        as much of the prompt as the winner and within `herd_s` of its score: a home member of the
        winner's tie if there is one, else the best within the margin (None: keep the winner).
        The shares are dealt over every worker of the pool, candidates or not, so that gateways
        whose candidates differ (a worker at one gateway's in-flight cap) still deal alike."""
        home = self._gateways.home([view.worker_id for view in workers], now_s)
        if not home or cands[chosen].worker_id in home:
            return None
        assert scorer.near is not None
        ids = [view.worker_id for view in cands]
        found = home_choice(scorer.near, home, ids, matched, scorer.best_score - herd_s)
        if found is not None:
            self._count("herd_home_choices")
        return found
