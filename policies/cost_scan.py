"""The per-worker part of a `cost` decision, kept to what a thousand workers can afford.

Every decision needs each worker's availability, load and prefill backlog. The pass that reads
them is built from list comprehensions, about a third cheaper on CPython 3.11 than one loop that
appends to three lists and looks up every worker in the prefix match; from 96 workers on, its
columns are kept per pool (`CandidateCache`) and only the views that are new objects since the
pool's last decision are read again. With `prefill_progress` the backlogs also drain with time
(`CostModel.prefill_remaining`): the whole backlogs are kept all the same, with the positions
whose backlog drains, and at each decision only those are drained again, by the model in one
pass over columns (`CostModel.prefill_left`), not a call per worker. After it:

- the holders of part of the prefix are found from the index match, each through its position
  in the candidate list remembered from earlier decisions (a full worker id → position map is
  rebuilt only when the list changes);
- the other workers are taken in order of raw backlog: beyond 128 of them, the first few from a
  heap (heapified in C, O(workers)) and the rest, when the scan goes on, from one sort of what is
  left (fewer workers are sorted once); the scan
  stops at the first one whose best possible score cannot reach the best so far. Sorting all of
  them up front by a key function, as a plain scan would, costs more than the scan itself on a
  hit.

Both give (backlog, position) in the order a stable sort by backlog gives, so the workers scored,
and the decision, are the same as scanning all of them in sorted order.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress
from operator import is_not, itemgetter

from policies.base import WorkerId, WorkerView
from policies.cost_model import CostModel, Drain
from policies.records import record


@record
class Candidates:
    """The available workers of one decision, as parallel columns.

    `loads`: in-flight requests, raised to what the worker reports (waiting + running) when it
    reports more (`policies.base.reported_load`), and `total_load` their sum. `pending`: in-flight
    prompt tokens (less the progress on them, given `remaining`), and `raw_backlog` the sum of the
    whole prompts. `backlogs`: prefill tokens left to compute, `pending` × the worker's uncached
    share when shares are given (else `pending` itself).
    """

    views: list[WorkerView]
    loads: list[int]
    backlogs: Sequence[float]
    pending: list[int]
    raw_backlog: int
    total_load: int


def _available(workers: Iterable[WorkerView]) -> list[WorkerView]:
    """The healthy workers below their in-flight limit, in the order given."""
    return [
        w
        for w in workers
        if w.healthy and (w.max_in_flight is None or w.in_flight_requests < w.max_in_flight)
    ]


def _loads(views: Iterable[WorkerView]) -> list[int]:
    # `policies.base.reported_load` inlined, without a call per worker (a call, `max` included,
    # costs as much as the rest of the expression): what the scrape reports beyond the gateway's
    # own requests (then, when the scrape says how many it had; else now) is load it did not send.
    return [
        w.in_flight_requests + excess
        if (waiting := w.num_requests_waiting) is not None
        and (
            excess := waiting
            + (w.num_requests_running or 0)
            - (w.in_flight_requests if (at := w.in_flight_at_scrape) is None else at)
        )
        > 0
        else w.in_flight_requests
        for w in views
    ]


def _backlogs(
    cands: list[WorkerView], pending: list[int], shares: Mapping[WorkerId, float]
) -> Sequence[float]:
    if not shares:
        return pending
    get = shares.get
    return [p * get(w.worker_id, 1.0) for p, w in zip(pending, cands, strict=True)]


def candidates(
    workers: Sequence[WorkerView],
    shares: Mapping[WorkerId, float],
    remaining: Drain | None = None,
) -> Candidates:
    """The healthy workers below their in-flight limit, in the order given, with their columns.
    `remaining` (`CostModel.remaining_at`) takes the progress since dispatch off `pending`: the
    score charges what is left, so the order and the bound of the scan must see the same."""
    views = _available(workers)
    loads = _loads(views)
    whole = [w.in_flight_prefill_tokens for w in views]
    pending = whole
    if remaining is not None:
        # The queue weight's prompts waiting stay whole (`raw_backlog`): only the queue drains.
        pending = _Draining(remaining.model, views).drained(remaining, whole)
    backlogs = _backlogs(views, pending, shares) if shares else pending
    return Candidates(views, loads, backlogs, pending, sum(whole), sum(loads))


class _Draining:
    """The candidates whose prefill backlog drains with time (its start known, tokens pending), by
    ascending candidate position, with the columns `CostModel.prefill_left` reads: each one's
    whole backlog, its start and its view's `step_s_per_token` (which depends on the view alone,
    so it is kept with it while the view is)."""

    __slots__ = ("model", "pending", "positions", "started_s", "steps")

    def __init__(self, model: CostModel, views: Sequence[WorkerView]) -> None:
        self.model = model
        self.positions = [
            j
            for j, w in enumerate(views)
            if w.prefill_started_s is not None and w.in_flight_prefill_tokens > 0
        ]
        draining = [views[j] for j in self.positions]
        self.pending = [w.in_flight_prefill_tokens for w in draining]
        self.started_s = [s for w in draining if (s := w.prefill_started_s) is not None]
        self.steps = model.step_s_per_token(draining)

    def drained(self, drain: Drain, whole: list[int]) -> list[int]:
        """`whole`, every candidate's backlog, with the draining ones' progress by `drain`'s
        instant taken off (`whole` itself when none drains)."""
        positions = self.positions
        if not positions:
            return whole
        left = drain.left(self.pending, self.started_s, self.steps)
        if len(left) == len(whole):
            return left  # every candidate drains: the positions are 0 … n − 1
        out = whole.copy()
        for j, x in zip(positions, left, strict=True):
            out[j] = x
        return out

    def set(self, j: int, view: WorkerView, step: float) -> None:
        """Candidate `j`'s view is now `view` (`step`: its `step_s_per_token`)."""
        positions = self.positions
        i = bisect_left(positions, j)
        here = i < len(positions) and positions[i] == j
        started = view.prefill_started_s
        tokens = view.in_flight_prefill_tokens
        if started is not None and tokens > 0:
            if here:
                self.pending[i], self.started_s[i], self.steps[i] = tokens, started, step
            else:
                positions.insert(i, j)
                self.pending.insert(i, tokens)
                self.started_s.insert(i, started)
                self.steps.insert(i, step)
        elif here:
            self._drop(i)

    def insert(self, j: int, view: WorkerView, step: float) -> None:
        """A candidate comes in at position `j`: the ones from `j` on move up one."""
        positions = self.positions
        i = bisect_left(positions, j)
        if i < len(positions):
            positions[i:] = [p + 1 for p in positions[i:]]
        self.set(j, view, step)

    def delete(self, j: int) -> None:
        """Candidate `j` leaves: the ones after it move down one."""
        positions = self.positions
        i = bisect_left(positions, j)
        if i < len(positions) and positions[i] == j:
            self._drop(i)
        if i < len(positions):
            positions[i:] = [p - 1 for p in positions[i:]]

    def _drop(self, i: int) -> None:
        del self.positions[i], self.pending[i], self.started_s[i], self.steps[i]


def _left_out(workers: Sequence[WorkerView], kept: Sequence[WorkerView]) -> list[int]:
    """Positions in `workers` of the views `_available` left out (`kept` is what it returned)."""
    out, j, m = [], 0, len(kept)
    for p, w in enumerate(workers):
        if j < m and kept[j] is w:
            j += 1
        else:
            out.append(p)
    return out


class CandidateCache:
    """`candidates` of one pool, kept from decision to decision and redone where a view changed.

    The gateway's registry (and the simulator) hand out the same `WorkerView` object for a worker
    until something in it changes (a view is a record: never changed once built), so from one
    decision to the next almost every view is the one seen before. Finding the positions whose view
    is a different object is one pass in C (about 20 ns a worker, a quarter of reading a view's
    load); only those are read again. A worker that becomes available or unavailable (an in-flight
    cap reached or left, as happens at every dispatch when the pool is saturated) is inserted into
    or deleted from the columns (a move in C). A change of the list's length, or of more than a
    quarter of the views, rebuilds all. Below `MIN_WORKERS` workers the pass is done afresh, and
    nothing is kept.

    With `remaining` (`CostModel.remaining_at`), what is left of a backlog changes with time, the
    model's scale and its mean prompt, not only with the view: it is worked out again at every
    decision, but only for the candidates whose backlog drains (a start known, tokens pending,
    `_Draining`), from columns kept with the views (each one's whole backlog, start and
    `step_s_per_token`), and laid over a copy of the whole backlogs (a copy in C; none when every
    candidate drains). A view taken in, inserted or deleted updates these columns too; a rebuild,
    or a call without `remaining`, drops them, and the next call that drains takes them again
    from the views.

    Invariant: `_workers[p]` is the view last seen at position p, `_off` the sorted positions of
    the unavailable ones, so position p (if available) is candidate p − (positions in `_off`
    before p); the columns equal `candidates(_workers, {})`; `_draining`, unless None, holds
    exactly the candidate positions whose view's backlog drains, ascending, with that view's
    columns (its `step_s_per_token` by `_draining.model`). The lists returned are the cache's own:
    valid until its next call, not to be kept or changed.
    """

    __slots__ = ("_cands", "_draining", "_off", "_workers")

    # A small pool's pass costs little, and a larger share of its views changes between two
    # decisions: at 64 workers keeping the columns broke even, at 128 it saved 10-13 %.
    MIN_WORKERS = 96

    def __init__(self) -> None:
        self._workers: list[WorkerView] = []
        self._off: list[int] = []
        self._cands = candidates((), {})
        self._draining: _Draining | None = None

    def candidates(
        self,
        workers: Sequence[WorkerView],
        shares: Mapping[WorkerId, float],
        remaining: Drain | None = None,
    ) -> Candidates:
        """As `candidates(workers, shares, remaining)`: the same columns, `pending` (and `backlogs`)
        drained by `remaining` where it is given."""
        n = len(workers)
        if n < self.MIN_WORKERS:
            return candidates(workers, shares, remaining)
        if n != len(self._workers):
            self._rebuild(workers)
        else:
            changed = list(compress(range(n), map(is_not, workers, self._workers)))
            if 4 * len(changed) > n:
                self._rebuild(workers)
            elif changed:
                self._patch(workers, changed)
        c = self._cands
        pending = c.pending
        if remaining is None:
            self._draining = None  # nothing drains: not kept
        else:
            draining = self._draining
            if draining is None or draining.model is not remaining.model:
                draining = self._draining = _Draining(remaining.model, c.views)
            pending = draining.drained(remaining, pending)
        if pending is c.pending and not shares:
            return c
        backlogs = _backlogs(c.views, pending, shares)
        return Candidates(c.views, c.loads, backlogs, pending, c.raw_backlog, c.total_load)

    def _rebuild(self, workers: Sequence[WorkerView]) -> None:
        self._workers = list(workers)
        self._cands = candidates(workers, {})
        views = self._cands.views
        self._off = [] if len(views) == len(workers) else _left_out(workers, views)
        self._draining = None  # taken again from the views by the next call that drains

    def _patch(self, workers: Sequence[WorkerView], changed: list[int]) -> None:
        """Take in the views at `changed` (ascending positions)."""
        new = [workers[p] for p in changed]
        kept = _available(new)
        left_out = set() if len(kept) == len(new) else set(_left_out(new, kept))
        seen, off = self._workers, self._off
        c = self._cands
        views, loads, pending = c.views, c.loads, c.pending
        raw, total = c.raw_backlog, c.total_load
        draining = self._draining
        steps = [] if draining is None else draining.model.step_s_per_token(new)
        for k, (p, w, load) in enumerate(zip(changed, new, _loads(new), strict=True)):
            seen[p] = w
            before = bisect_left(off, p) if off else 0
            j = p - before  # its candidate position (if it is or was one)
            was = before == len(off) or off[before] != p  # available until now
            if k in left_out:
                if was:
                    off.insert(before, p)
                    total -= loads.pop(j)
                    raw -= pending.pop(j)
                    del views[j]
                    if draining is not None:
                        draining.delete(j)
                continue
            b = w.in_flight_prefill_tokens
            if was:
                total += load - loads[j]
                raw += b - pending[j]
                views[j], loads[j], pending[j] = w, load, b
                if draining is not None:
                    draining.set(j, w, steps[k])
            else:
                del off[before]
                views.insert(j, w)
                loads.insert(j, load)
                pending.insert(j, b)
                total += load
                raw += b
                if draining is not None:
                    draining.insert(j, w, steps[k])
        self._cands = Candidates(views, loads, pending, pending, raw, total)


class Positions:
    """Worker id → position in the candidate list, checked per holder and rebuilt only when stale.

    A gateway lists the same workers in the same order decision after decision, so a holder's
    remembered position is almost always still right: checking it costs one comparison, where
    mapping every candidate's id would cost a pass over all of them. Worker ids in one candidate
    list are distinct (a pool lists each worker once).
    """

    __slots__ = ("_ids", "_pos")

    def __init__(self) -> None:
        self._ids: list[WorkerId] = []
        self._pos: dict[WorkerId, int] = {}

    def held(
        self, views: Sequence[WorkerView], blocks_by_worker: Mapping[WorkerId, int]
    ) -> list[tuple[int, int]]:
        """(candidate position, matched blocks) of every candidate holding part of the prefix."""
        out = []
        pos = self._pos
        n = len(views)
        for worker, blocks in blocks_by_worker.items():
            if not blocks:
                continue
            i = pos.get(worker)
            if i is None or i >= n or views[i].worker_id != worker:
                ids = [w.worker_id for w in views]
                if ids != self._ids:
                    self._ids = ids
                    pos = self._pos = {w: i for i, w in enumerate(ids)}
                i = pos.get(worker)
                if i is None:
                    continue  # not a candidate (unavailable, or not in this pool)
            out.append((i, blocks))
        return out


def by_backlog(cands: Candidates, lazy: int = 16) -> Iterator[int]:
    """Candidate positions in ascending backlog, ties by position (a stable sort's order).

    Up to 128 candidates, one sort. Beyond, the first `lazy` come from a heap one at a time (a
    scan usually stops within them), and a longer scan sorts what is left once, which is cheaper
    than popping the heap for every worker.
    """
    backlogs = cands.backlogs
    if len(backlogs) <= 128:
        return iter(sorted(range(len(backlogs)), key=backlogs.__getitem__))
    return _heap_order(cands, lazy)


def _heap_order(cands: Candidates, lazy: int) -> Iterator[int]:
    return chain.from_iterable(_heap_parts(cands, lazy))


def _heap_parts(cands: Candidates, lazy: int) -> Iterator[Iterator[int]]:
    # `chain` asks for the second part only once the first is used up: the sort happens then.
    n = len(cands.views)
    if cands.backlogs is cands.pending:
        # Integer backlogs: one int per candidate, backlog·n + position, orders exactly like the
        # pair without allocating n tuples.
        keys = [b * n + i for i, b in enumerate(cands.pending)]
        heapq.heapify(keys)
        yield (heapq.heappop(keys) % n for _ in range(min(lazy, n)))
        keys.sort()
        yield map(n.__rmod__, keys)
        return
    pairs = [(b, i) for i, b in enumerate(cands.backlogs)]
    heapq.heapify(pairs)
    yield (heapq.heappop(pairs)[1] for _ in range(min(lazy, n)))
    pairs.sort()
    yield map(itemgetter(1), pairs)


def fewest_in_flight(
    loads: Sequence[int], backlogs: Sequence[float], bound: float, rng: random.Random
) -> int:
    """The candidate with load within `bound` and the fewest requests in flight, then the longest
    backlog (one already busy with a long prompt, so that an idle worker stays free for requests
    that can still meet an objective), ties at random; past every bound, the least loaded of all."""
    best: list[int] = []
    best_key: tuple[float, float] | None = None
    for i, load in enumerate(loads):
        if load > bound:
            continue
        key = (load, -backlogs[i])
        if best_key is None or key < best_key:
            best_key, best = key, [i]
        elif key == best_key:
            best.append(i)
    if not best:
        return fewest_in_flight(loads, backlogs, math.inf, rng)
    return best[0] if len(best) == 1 else rng.choice(best)
