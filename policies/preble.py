"""`preble_e2`: Preble's E2 global scheduler (exploit or explore), as in WukLab/preble.

From shared/reference/workloads-and-results.md §5.1 (`preble/global_scheduler_with_time.py`):
- cached = the longest prefix any worker holds, missed = prompt − cached;
- cached > missed → exploit: among the workers holding that prefix, the lowest load cost;
- otherwise → explore: the lowest load cost over all workers;
- load cost of g = prefill work routed to g in a 3-minute sliding window
  (Σ T_prefill(missed, cached)) + active requests × median output length × TPOT_g.
Not reproduced: important-node bookkeeping (the window here is per request, not per tree node),
post-assignment rebalancing and autoscaling, and the local priority queue.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from policies.base import Observation, RouteDecision, RouteRequest, WorkerId, WorkerView
from policies.pools import available
from policies.prefix_policy import PrefixPolicyBase, SharedSettings
from policies.registry import register_policy


@register_policy("preble_e2")
class PrebleE2(PrefixPolicyBase):
    """Exploit the holders when the cached prefix outweighs the miss, else the least load cost."""

    name: ClassVar[str]

    def __init__(
        self,
        *,
        seed: int = 0,
        window_s: float = 180.0,
        output_history: int = 200,
        shared: SharedSettings | None = None,
    ) -> None:
        if window_s <= 0 or output_history < 1:
            raise ValueError("window_s must be > 0 and output_history >= 1")
        super().__init__(seed=seed, shared=shared)
        self.window_s = window_s
        self._window: dict[WorkerId, deque[tuple[float, float]]] = {}
        self._window_sum: dict[WorkerId, float] = {}
        self._outputs: deque[int] = deque(maxlen=output_history)
        self._median_output = 256.0

    def _forget_load(self, pool: str, worker: WorkerId, gone: bool) -> None:
        self._window.pop(worker, None)
        self._window_sum.pop(worker, None)

    def _prefill_load(self, worker: WorkerId, now_s: float) -> float:
        window = self._window.get(worker)
        if not window:
            return 0.0
        horizon = now_s - self.window_s
        total = self._window_sum[worker]
        while window and window[0][0] < horizon:
            total -= window.popleft()[1]
        self._window_sum[worker] = max(0.0, total)
        return self._window_sum[worker]

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        cands = available(workers)
        if not cands:
            return None
        pool = self._pool(req)
        self._pools.note_workers(req.pool, cands)
        pool.observe_workers(cands)
        mine = self._own_keys(req)
        match = pool.index.lookup(mine.keys, mine.namespace, now_s)
        cached = self._cap_tokens(req, match.longest_blocks)
        missed = req.n_prompt_tokens - cached
        cost = pool.cost

        def load_cost(view: WorkerView) -> float:
            tpot = cost.decode_step_s(view.in_flight_requests, view.in_flight_decode_tokens)
            decode = view.in_flight_requests * self._median_output * tpot
            return self._prefill_load(view.worker_id, now_s) + decode

        if cached > missed:
            holders = [v for v in cands if match.blocks(v.worker_id) == match.longest_blocks]
            reason, pool_of = "exploit", holders or cands
        else:
            reason, pool_of = "explore", cands
        chosen = min(pool_of, key=load_cost)
        matched = self._cap_tokens(req, match.blocks(chosen.worker_id))
        self._decisions.add(reason)
        # Charge the prefill this request brings to the chosen worker's window.
        if chosen.worker_id not in self._window and len(self._window) >= 4096:
            # Bounded across worker churn: drop the longest-idle worker's window.
            idle = min(self._window, key=lambda w: self._window[w][-1][0] if self._window[w] else -1.0)
            del self._window[idle]
            self._window_sum.pop(idle, None)
        window = self._window.setdefault(chosen.worker_id, deque())
        work = cost.prefill_s(req.n_prompt_tokens - matched, matched)
        window.append((now_s, work))
        self._window_sum[chosen.worker_id] = self._window_sum.get(chosen.worker_id, 0.0) + work
        if len(window) > 100_000:
            self._window_sum[chosen.worker_id] -= window.popleft()[1]
        return RouteDecision(chosen.worker_id, -load_cost(chosen), reason, matched)

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        # Preble inserts every request into its global tree at assignment time.
        mine = self._own_keys(req)
        self._pool(req).index.record(mine.keys, decision.worker, mine.namespace, now_s, speculative=False)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        if obs.failed or obs.completion_tokens is None:
            return
        self._outputs.append(obs.completion_tokens)
        self._median_output = float(statistics.median(self._outputs))
