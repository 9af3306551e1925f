"""Cache-blind baselines: round_robin, random, least_load, and consistent_hash (CHWBL).

consistent_hash is consistent hashing with bounded loads (Mirrokni et al.; KubeAI's CHWBL): the
request's routing key (session key, else the chained key of an early prompt block) lands on a
ring of virtual nodes; walk clockwise to the first worker whose in-flight load stays within
ceil(c·(total+1)/n). It keeps affinity without any index, and sheds load off hot keys.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from policies.base import KvEvent, Observation, RouteDecision, RouteRequest, WorkerId, WorkerView
from policies.pools import available, load_of
from policies.registry import register_policy
from policies.stats import DecisionCounter, PolicyStats


class _Stateless:
    """Feedback hooks and counters for policies that ignore prefixes."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._decisions = DecisionCounter()

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        return None

    def on_complete(self, obs: Observation, now_s: float) -> None:
        return None

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        return None

    def stats(self) -> PolicyStats:
        return PolicyStats(policy=self.name, decisions_by_reason=self._decisions.snapshot())

    def _decide(self, view: WorkerView, score_s: float, reason: str) -> RouteDecision:
        self._decisions.add(reason)
        return RouteDecision(view.worker_id, score_s, reason)


@register_policy("round_robin")
class RoundRobin(_Stateless):
    """Cycle through available workers in the order given."""

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__()
        self._next = 0

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        candidates = available(workers)
        if not candidates:
            return None
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return self._decide(chosen, 0.0, "round_robin")


@register_policy("random")
class RandomChoice(_Stateless):
    """Uniformly random among available workers (seeded)."""

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        candidates = available(workers)
        if not candidates:
            return None
        return self._decide(self._rng.choice(candidates), 0.0, "random")


@register_policy("least_load")
class LeastLoad(_Stateless):
    """Fewest in-flight requests (raised to the worker's own report), then fewest in-flight prefill
    tokens; remaining ties go to a random one of them, so a quiet pool does not pile onto worker 0."""

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        candidates = available(workers)
        if not candidates:
            return None
        keyed = [((load_of(w), w.in_flight_prefill_tokens), w) for w in candidates]
        best = min(k for k, _ in keyed)
        ties = [w for k, w in keyed if k == best]
        chosen = ties[0] if len(ties) == 1 else self._rng.choice(ties)
        return self._decide(chosen, -float(best[0]), "least_load")


@register_policy("consistent_hash")
class ConsistentHashBoundedLoad(_Stateless):
    """Consistent hashing with bounded loads (CHWBL) on the session key or an early prefix block."""

    def __init__(
        self, *, seed: int = 0, load_factor: float = 1.25, vnodes: int = 100, prefix_blocks: int = 4
    ) -> None:
        if load_factor < 1.0 or vnodes < 1 or prefix_blocks < 1:
            raise ValueError("need load_factor >= 1, vnodes >= 1, prefix_blocks >= 1")
        super().__init__()
        self.load_factor = load_factor
        self.vnodes = vnodes
        self.prefix_blocks = prefix_blocks
        self._seed = seed
        self._ring_for: tuple[WorkerId, ...] = ()
        self._points: list[int] = []
        self._owners: list[WorkerId] = []

    def _ring(self, workers: Sequence[WorkerView]) -> None:
        ids = tuple(sorted(w.worker_id for w in workers))
        if ids == self._ring_for:
            return
        pairs = sorted(
            (xxhash.xxh3_64_intdigest(f"{wid}#{v}".encode(), seed=self._seed), wid)
            for wid in ids
            for v in range(self.vnodes)
        )
        self._points = [p for p, _ in pairs]
        self._owners = [w for _, w in pairs]
        self._ring_for = ids

    def _key(self, req: RouteRequest) -> int:
        if req.session_key:
            return xxhash.xxh3_64_intdigest(req.session_key.encode(), seed=self._seed)
        if req.block_keys:
            # Hash a few blocks in, not block 0: a prompt shared by everyone would pin one worker.
            return int(req.block_keys[min(self.prefix_blocks, len(req.block_keys)) - 1])
        return xxhash.xxh3_64_intdigest(req.request_id.encode(), seed=self._seed)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        candidates = available(workers)
        if not candidates:
            return None
        self._ring(candidates)
        by_id = {w.worker_id: w for w in candidates}
        loads = {w.worker_id: load_of(w) for w in candidates}
        bound = math.ceil(self.load_factor * (sum(loads.values()) + 1) / len(candidates))
        start = bisect.bisect_left(self._points, self._key(req) % (1 << 64))
        n = len(self._points)
        tried: set[WorkerId] = set()
        for step in range(n):
            wid = self._owners[(start + step) % n]
            if wid in tried:
                continue
            tried.add(wid)
            if loads[wid] + 1 <= bound:
                reason = "ring" if step == 0 or len(tried) == 1 else "ring_overflow"
                return self._decide(by_id[wid], 0.0, reason)
            if len(tried) == len(candidates):
                break
        fallback = min(candidates, key=lambda w: loads[w.worker_id])
        return self._decide(fallback, 0.0, "ring_full")
