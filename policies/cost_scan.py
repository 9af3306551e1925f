"""The per-worker part of a `cost` decision, kept to what a thousand workers can afford.

Every decision must read each worker's view once (availability, load, prefill backlog): that pass
is built from list comprehensions, about a third cheaper on CPython 3.11 than one loop that
appends to three lists and looks up every worker in the prefix match. After it:

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain
from operator import itemgetter

from policies.base import WorkerId, WorkerView
from policies.records import record


@record
class Candidates:
    """The available workers of one decision, as parallel columns.

    `loads`: in-flight requests, raised to what the worker reports (waiting + running) when it
    reports more (`policies.base.reported_load`). `pending`: in-flight prompt tokens (less the
    progress on them, given `remaining`), and `raw_backlog` the sum of the whole prompts.
    `backlogs`: prefill tokens left to compute, `pending` × the worker's uncached share when
    shares are given (else `pending` itself).
    """

    views: list[WorkerView]
    loads: list[int]
    backlogs: Sequence[float]
    pending: list[int]
    raw_backlog: int


def candidates(
    workers: Sequence[WorkerView],
    shares: Mapping[WorkerId, float],
    remaining: Callable[[WorkerView], int] | None = None,
) -> Candidates:
    """The healthy workers below their in-flight limit, in the order given, with their columns.
    `remaining` (`CostModel.remaining_at`) takes the progress since dispatch off `pending`: the
    score charges what is left, so the order and the bound of the scan must see the same."""
    views = [
        w
        for w in workers
        if w.healthy and (w.max_in_flight is None or w.in_flight_requests < w.max_in_flight)
    ]
    # `policies.base.reported_load` inlined, without a call per worker (a call, `max` included,
    # costs as much as the rest of the expression): what the scrape reports beyond the gateway's
    # own requests (then, when the scrape says how many it had; else now) is load it did not send.
    loads = [
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
    pending = [w.in_flight_prefill_tokens for w in views]
    raw = sum(pending)
    if remaining is not None:
        # The queue weight's prompts waiting stay whole (`raw_backlog`): only the queue drains.
        pending = [
            p if w.prefill_started_s is None else remaining(w) for p, w in zip(pending, views, strict=True)
        ]
    if shares:
        get = shares.get
        backlogs = [p * get(w.worker_id, 1.0) for p, w in zip(pending, views, strict=True)]
        return Candidates(views, loads, backlogs, pending, raw)
    return Candidates(views, loads, pending, pending, raw)


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
