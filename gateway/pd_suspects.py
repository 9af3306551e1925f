"""Blame for SGLang pairs whose failure pointed at neither worker.

An SGLang decode worker that answers 5xx while its pair's prefill leg is still out leaves the
round inconclusive (`pd_pairs.PdRun.avoided`): a broken decode worker does that, and so does a
prefill worker that hangs (its decode worker gives up on the KV). Neither gets a verdict then,
and a pool with a broken decode worker made every request that met it pay a round, with no
breaker ever opening.

What tells them apart comes later: the prefill worker serving a pair with another decode worker
shows that it works, so the decode worker was at fault, and the other way round. A request's
inconclusive pairs are noted once the request itself is served (so it was not a request no
worker can take: the same rule as `outcome.HeldVerdicts`), and every served SGLang pair of the
pool (this request's or a later one's) settles the noted pairs it shares one worker with: the
other worker's breaker counts a failure for each round the pair failed. A pair served as a whole
clears its note. Notes are bounded and expire.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.breaker import BreakerState
from gateway.worker import Worker
from policies.base import WorkerId

NOTE_TTL_S = 60.0  # a note not settled in this time is dropped: the evidence is stale
MAX_NOTES = 256


class InconclusivePairs:
    """A pool's noted inconclusive pairs, by (prefill, decode) worker ids."""

    __slots__ = ("_notes",)

    def __init__(self) -> None:
        # (prefill, decode) -> (prefill, decode, rounds failed, when last)
        self._notes: OrderedDict[tuple[WorkerId, WorkerId], tuple[Worker, Worker, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._notes)

    def note(self, prefill: Worker, decode: Worker, now_s: float) -> None:
        key = (prefill.worker_id, decode.worker_id)
        found = self._notes.pop(key, None)
        self._notes[key] = (prefill, decode, 1 if found is None else found[2] + 1, now_s)
        while len(self._notes) > MAX_NOTES:
            self._notes.popitem(last=False)

    def served(self, prefill: WorkerId, decode: WorkerId, now_s: float) -> list[Worker]:
        """A pair of `prefill` and `decode` served a request: settle the notes it shares one worker
        with (their other worker's breaker counts a failure). Returns the workers blamed."""
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
                breaker = worker.breaker
                for _ in range(rounds):
                    if breaker.state(now_s) is BreakerState.OPEN:
                        break
                    breaker.on_failure(now_s)
                blamed.append(worker)
        return blamed
