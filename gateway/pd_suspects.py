"""Blame for SGLang pairs whose failure pointed at neither worker.

An SGLang decode worker that answers 5xx while its pair's prefill leg is still out leaves the
round inconclusive (`pd_pairs.PdRun.avoided`): a broken decode worker does that, and so does a
prefill worker that hangs (its decode worker gives up on the KV). Neither gets a verdict then,
and a pool with a broken decode worker made every request that met it pay a round, with no
breaker ever opening.

A worker is shown at fault by triangulation: it failed so, within `WITHIN_S`, paired with at
least two other workers that each served a pair since they first failed with it in that time
(so they work, and did after that failure: two workers that broke together, say on one node,
do not clear each other's partner). A request's
inconclusive pairs are weighed once the request itself is served (so it was not a request no
worker can take: the same rule as `outcome.HeldVerdicts`), after the pair that served it is
counted; each worker so shown at fault has its breaker count a failure for the round. One
partner alone proves nothing: a healthy prefill worker paired with a decode worker that fails
now and then looks the same as a broken prefill worker paired with a healthy one. So a pool with
one prefill worker (or one decode worker) never blames this way, and its requests that meet such
a worker still pay a round each (docs/pd.md). An overloaded decode worker's 503 or 529 is not
inconclusive: it took no part in the transfer, and is its own (`pd_legs.decode_leg`).
"""

from __future__ import annotations

from gateway.breaker import BreakerState
from gateway.worker import Worker
from policies.base import WorkerId

WITHIN_S = 60.0  # how recent a served pair, or a failed one, must be to count
_MAX_WORKERS = 4096  # workers remembered (a pool's, with discovery's churn); then the stale go
_MAX_PARTNERS = 64  # partners remembered per worker; then the oldest go


class InconclusivePairs:
    """When each of a pool's workers last served a pair, and with whom each last failed one
    inconclusively."""

    __slots__ = ("_failed", "_served")

    def __init__(self) -> None:
        self._served: dict[WorkerId, float] = {}
        self._failed: dict[WorkerId, dict[WorkerId, float]] = {}  # worker -> partner -> when

    def served(self, prefill: WorkerId, decode: WorkerId, now_s: float) -> None:
        """A pair of `prefill` and `decode` served a request: both work."""
        served = self._served
        if len(served) >= _MAX_WORKERS and (prefill not in served or decode not in served):
            self._served = served = {w: t for w, t in served.items() if now_s - t < WITHIN_S}
        served[prefill] = served[decode] = now_s

    def note(self, prefill: Worker, decode: Worker, now_s: float) -> list[Worker]:
        """A pair failed pointing at neither worker, in a request since served: count it, and
        blame (a failure on the breaker unless open) whichever of the two it shows at fault."""
        self._pair_failed(prefill.worker_id, decode.worker_id, now_s)
        self._pair_failed(decode.worker_id, prefill.worker_id, now_s)
        blamed = [w for w in (prefill, decode) if self._at_fault(w.worker_id, now_s)]
        for worker in blamed:
            if worker.breaker.state(now_s) is not BreakerState.OPEN:
                worker.breaker.on_failure(now_s)
        return blamed

    def _pair_failed(self, worker: WorkerId, partner: WorkerId, now_s: float) -> None:
        failed = self._failed
        if len(failed) >= _MAX_WORKERS and worker not in failed:
            self._failed = failed = {
                w: p for w, p in failed.items() if any(now_s - t < WITHIN_S for t in p.values())
            }
        partners = failed.setdefault(worker, {})
        first = partners.pop(partner, None)
        # The first failure of the pair within the window: the partner works if it served since.
        partners[partner] = first if first is not None and now_s - first < WITHIN_S else now_s
        if len(partners) > _MAX_PARTNERS:
            del partners[next(iter(partners))]

    def _at_fault(self, worker: WorkerId, now_s: float) -> bool:
        """Whether `worker` failed, lately, paired with two or more workers that have served a
        pair since their first such failure (one that served only before may have broken)."""
        partners = self._failed.get(worker)
        if partners is None or len(partners) < 2:
            return False
        served = self._served
        working = 0
        for partner, when in partners.items():
            last = served.get(partner)
            if now_s - when < WITHIN_S and last is not None and last >= when:
                working += 1
        return working >= 2
