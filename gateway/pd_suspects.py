"""Blame for SGLang pairs whose failure pointed at neither worker.

An SGLang decode worker that answers 5xx while its pair's prefill leg is still out leaves the
round inconclusive (`pd_pairs.PdRun.avoided`): a broken decode worker does that, and so does a
prefill worker that hangs (its decode worker gives up on the KV). Neither gets a verdict then,
and a pool with a broken decode worker made every request that met it pay a round, with no
breaker ever opening.

What tells them apart is the pairs that work: a worker that served a pair shortly before, or
serves one after, works, so the other worker of the failed pair was at fault. A request's
inconclusive pairs are weighed once the request itself is served (so it was not a request no
worker can take: the same rule as `outcome.HeldVerdicts`): where exactly one of the two workers
served a pair within `SERVED_WITHIN_S`, the other one's breaker counts a failure at once; where
neither did (or both), the pair is noted, and the next served pair of the pool that shares one
of its workers settles it, the other worker's breaker counting a failure for each round the
pair failed. A pair served as a whole clears its note. Notes are bounded and expire.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.breaker import BreakerState
from gateway.worker import Worker
from policies.base import WorkerId

SERVED_WITHIN_S = 30.0  # a worker that served a pair this recently is taken to work
NOTE_TTL_S = 60.0  # a note not settled in this time is dropped: the evidence is stale
MAX_NOTES = 256
_MAX_SERVED = 4096  # workers remembered as having served (a pool's, with discovery's churn)


class InconclusivePairs:
    """A pool's noted inconclusive pairs, by (prefill, decode) worker ids, and when each of its
    workers last served a pair."""

    __slots__ = ("_notes", "_served")

    def __init__(self) -> None:
        # (prefill, decode) -> (prefill, decode, rounds failed, when last)
        self._notes: OrderedDict[tuple[WorkerId, WorkerId], tuple[Worker, Worker, int, float]] = OrderedDict()
        self._served: dict[WorkerId, float] = {}

    def __len__(self) -> int:
        return len(self._notes)

    def note(self, prefill: Worker, decode: Worker, now_s: float) -> Worker | None:
        """A pair failed pointing at neither worker, in a request since served: blame the one
        that has not served a pair lately while the other has (returned), else note the pair."""
        p_works = self._works(prefill.worker_id, now_s)
        if p_works != self._works(decode.worker_id, now_s):
            worker = decode if p_works else prefill
            _blame(worker, 1, now_s)
            return worker
        key = (prefill.worker_id, decode.worker_id)
        found = self._notes.pop(key, None)
        self._notes[key] = (prefill, decode, 1 if found is None else found[2] + 1, now_s)
        while len(self._notes) > MAX_NOTES:
            self._notes.popitem(last=False)
        return None

    def served(self, prefill: WorkerId, decode: WorkerId, now_s: float) -> list[Worker]:
        """A pair of `prefill` and `decode` served a request: remember it, and settle the notes it
        shares one worker with. Returns the workers blamed."""
        served = self._served
        if len(served) >= _MAX_SERVED and prefill not in served:
            self._served = served = {w: t for w, t in served.items() if now_s - t < SERVED_WITHIN_S}
        served[prefill] = served[decode] = now_s
        notes = self._notes
        if not notes:
            return []
        while notes:
            oldest = next(iter(notes.values()))
            if now_s - oldest[3] < NOTE_TTL_S:
                break
            notes.popitem(last=False)
        blamed: list[Worker] = []
        for key, (p, d, rounds, _) in list(notes.items()):
            if key == (prefill, decode):
                del notes[key]  # both work: the failure came and went
            elif key[0] == prefill or key[1] == decode:
                del notes[key]
                worker = d if key[0] == prefill else p
                _blame(worker, rounds, now_s)
                blamed.append(worker)
        return blamed

    def _works(self, worker: WorkerId, now_s: float) -> bool:
        when = self._served.get(worker)
        return when is not None and now_s - when < SERVED_WITHIN_S


def _blame(worker: Worker, rounds: int, now_s: float) -> None:
    """`rounds` failures on the worker's breaker, none once it is open (a verdict is not stretched
    over an open breaker's cooldown)."""
    breaker = worker.breaker
    for _ in range(rounds):
        if breaker.state(now_s) is BreakerState.OPEN:
            break
        breaker.on_failure(now_s)
