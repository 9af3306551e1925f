"""What `cost` has routed to each worker, kept incrementally for its score.

Two ledgers, both fed by this gateway's dispatches (and, for the work, its peers'):
- `InflightLedger`: the requests dispatched and not yet finished, per worker the sums of their
  prompt tokens and of the tokens predicted uncached. The gateway's prefill backlog counts whole
  prompts; the share turns it into the tokens left to compute (`discount_cached_backlog`).
- `RecentWork`: prefill seconds routed to each worker, decayed over a window, which the score
  charges a request that starts a branch (`branch_load_weight`), and their mean per dispatch, which
  sizes the herd margin (`HerdingPolicy.herd_margin_s`, `policies.cost_herd`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice

from policies.base import WorkerId


class InflightLedger:
    """Dispatched, unfinished requests: (request id, worker) → (prompt tokens, predicted uncached
    tokens), and per worker their sums and the uncached share (`shares`, absent: none in flight).

    An entry is one request's on one worker: the two legs of an SGLang prefill/decode pair are in
    flight at once under the request's one id, each on its own worker, and each leaves when its
    own outcome comes. Every entry's prompt is > 0, so each has its worker's sums to be taken
    from. Each worker's entries are also kept in dispatch order (`_by_worker`, the same entries as
    `_inflight`'s for that worker, in the same order), so that the newest ones, the prompts still
    waiting for their prefill under first-come-first-served, can be read without a pass over
    every request in flight (`pending_share`)."""

    MAX_INFLIGHT = 65_536
    MAX_PENDING_WALK = 256  # `pending_share` reads at most this many of a worker's newest entries

    def __init__(self) -> None:
        self._inflight: OrderedDict[tuple[str, WorkerId], tuple[int, int]] = OrderedDict()
        self._sums: dict[WorkerId, tuple[int, int]] = {}
        self.shares: dict[WorkerId, float] = {}
        self._by_worker: dict[WorkerId, OrderedDict[str, tuple[int, int]]] = {}

    def share(self, worker: WorkerId) -> float:
        """Predicted uncached share of the prompts in flight on `worker` (1 if none)."""
        return self.shares.get(worker, 1.0)

    def pending_share(self, worker: WorkerId, pending_tokens: int) -> float:
        """Predicted uncached share of `worker`'s newest prompts in flight, as many as add up to
        `pending_tokens` (the gateway's prefill backlog there: under first-come-first-served
        prefill, the prompts not yet at their first token are the last dispatched). 1 if none.

        `share` counts every prompt in flight, those decoding too: a holder decoding many mostly
        cached turns and computing one long new one has that one discounted with them."""
        entries = self._by_worker.get(worker)
        if entries is None or pending_tokens <= 0:
            return 1.0
        total = new = 0
        for prompt, uncached in islice(reversed(entries.values()), self.MAX_PENDING_WALK):
            total += prompt
            new += uncached
            if total >= pending_tokens:
                break
        return new / total

    def add(self, request_id: str, worker: WorkerId, prompt: int, uncached: int) -> None:
        inflight = self._inflight
        key = (request_id, worker)
        if key in inflight:
            self.remove(request_id, worker)
        if prompt <= 0:
            # Adds nothing to the sums (a prompt estimated at 0 tokens, e.g. "hi"); left out so
            # that every entry has its worker's sums to be taken from (`remove`).
            return
        inflight[key] = (prompt, uncached)
        entries = self._by_worker.get(worker)
        if entries is None:
            entries = self._by_worker[worker] = OrderedDict()
        entries[request_id] = (prompt, uncached)
        sums = self._sums.get(worker)
        if sums is None:
            total, new = prompt, uncached
        else:
            total, new = sums[0] + prompt, sums[1] + uncached
        # `_set` with a total > 0 (every sum is, and so is `prompt`).
        self._sums[worker] = (total, new)
        self.shares[worker] = new / total
        if len(inflight) > self.MAX_INFLIGHT:
            self.remove(*next(iter(self._inflight)))

    def remove(self, request_id: str, worker: WorkerId) -> None:
        found = self._inflight.pop((request_id, worker), None)
        if found is None:
            return
        prompt, uncached = found
        entries = self._by_worker[worker]
        del entries[request_id]
        if not entries:
            del self._by_worker[worker]
        total, new = self._sums[worker]
        self._set(worker, total - prompt, new - uncached)

    def check_invariants(self) -> None:
        sums: dict[WorkerId, tuple[int, int]] = {}
        for (_, worker), (prompt, uncached) in self._inflight.items():
            total, new = sums.get(worker, (0, 0))
            sums[worker] = (total + prompt, new + uncached)
        assert sums == self._sums
        by_worker: dict[WorkerId, list[tuple[str, tuple[int, int]]]] = {}
        for (request_id, worker), entry in self._inflight.items():
            by_worker.setdefault(worker, []).append((request_id, entry))
        assert by_worker == {w: list(entries.items()) for w, entries in self._by_worker.items()}
        assert self.shares == {w: new / total for w, (total, new) in sums.items()}

    def _set(self, worker: WorkerId, total: int, new: int) -> None:
        if total <= 0:
            self._sums.pop(worker, None)
            self.shares.pop(worker, None)
        else:
            self._sums[worker] = (total, new)
            self.shares[worker] = new / total


class RecentWork:
    """Per worker: prefill seconds routed there (the model's, before calibration), decayed with time
    constant `window_s`, and when that was last brought up to date (`by_worker`, read by
    `policies.cost_scorer.Scorer.charge_branches`); and the prefill seconds per dispatch, a moving
    average (`mean_s`)."""

    MEAN_WORK_DISPATCHES = 64
    MAX_WORKERS = 4096

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.by_worker: dict[WorkerId, tuple[float, float]] = {}
        self.mean_s = 0.0
        self._samples = 0

    def forget(self, worker: WorkerId) -> None:
        """Drop `worker`'s work: it left the pool."""
        self.by_worker.pop(worker, None)

    def restart(self, worker: WorkerId, pool: Iterable[WorkerId]) -> None:
        """`worker` joined or may have restarted: the work routed there no longer says where
        its sessions' next requests go (their KV went with it). It starts again at the mean work
        of the other workers of its pool (`pool`, decayed to the latest of their times), not at
        nothing: at nothing, every new branch would go to it until the work routed there caught
        up with the others' (minutes of short requests after a restart). Without other workers
        known, it is dropped."""
        recent = self.by_worker
        recent.pop(worker, None)
        others = [recent[w] for w in pool if w != worker and w in recent]
        if not others:
            return
        latest = max(at_s for _, at_s in others)
        mean = sum(work * math.exp(-(latest - at_s) / self.window_s) for work, at_s in others) / len(others)
        if len(recent) >= self.MAX_WORKERS:
            recent.pop(next(iter(recent)))
        recent[worker] = (mean, latest)

    def at(self, worker: WorkerId, now_s: float) -> float:
        """`worker`'s decayed work at `now_s`."""
        found = self.by_worker.get(worker)
        if found is None:
            return 0.0
        work, at_s = found
        return work * math.exp(-max(0.0, now_s - at_s) / self.window_s)

    def add(self, worker: WorkerId, work: float, now_s: float) -> None:
        recent = self.by_worker
        found = recent.get(worker)
        if found is None:
            if len(recent) >= self.MAX_WORKERS:
                recent.pop(next(iter(recent)))  # bounded across worker churn
            recent[worker] = (0.0 + work, now_s)
        else:
            before, at_s = found  # `at`, inlined
            elapsed = now_s - at_s
            decayed = before * math.exp(-(elapsed if elapsed > 0.0 else 0.0) / self.window_s)
            recent[worker] = (decayed + work, now_s)
        # The mean over the first dispatches, then a moving average over the last ~64.
        self._samples = min(self._samples + 1, self.MEAN_WORK_DISPATCHES)
        self.mean_s += (work - self.mean_s) / self._samples
