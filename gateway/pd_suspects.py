"""Blame for SGLang pairs whose failure pointed at neither worker.

An SGLang decode worker that answers 5xx while its pair's prefill leg is still out leaves the
round inconclusive (`pd_pairs.PdRun.avoided`): a broken decode worker does that, and so does a
prefill worker that hangs (its decode worker gives up on the KV). Neither gets a verdict then,
and a pool with a broken decode worker made every request that met it pay a round, with no
breaker ever opening. A request's inconclusive pairs are weighed once the request itself is
served (so it was not a request no worker can take: the same rule as `outcome.HeldVerdicts`),
after the pair that served it is counted, all together whatever order they failed in
(`note_request`), by two rules; a worker either rule shows at fault has its breaker count the
failures (none while it is open).

Triangulation. A worker failed so, within `WITHIN_S`, paired with at least two other workers
that each served a pair since they first failed with it in that time (so they work, and did
after that failure: two workers that broke together, say on one node, do not clear each other's
partner). Each such round counts one failure, and ends the worker's one-partner streak (below):
avoiding it for a probe would only stop its rounds being counted.

Partners that work. A failure with a partner that has served no pair since it first failed so
with the worker, within `WITHIN_S`, says nothing of the worker: that partner may be broken
itself. Triangulation does not count it, and the one-partner rule (below) skips it: it neither
begins, extends nor ends a streak, nor makes a second partner in a request. Two prefill and two
decode workers, one prefill worker stuck and one decode worker answering 500 to every pair:
each broken one fails with the healthy worker of the other role (which serves pairs with the
other healthy one) and with the other broken one (which never serves), so triangulation has one
partner that works for each, and the one-partner rule weighs each against it (counted, the
failures with the broken partner would end each streak, and neither breaker would open).
Skipping them leaves the one-partner bound as it is: it rests on the working partner's failures.
Blaming at once a worker whose every failure is with a partner that works or with one already
blamed would not: one failure of a flapping partner would do (the probe tells the two apart).

One partner. With one prefill worker (or one decode worker) triangulation has nothing to go
on, and watching alone cannot tell: a healthy prefill worker W that the routing policy tries
first every time, paired with the one decode worker X failing every other pair, fails in every
request while the retry on another prefill worker serves it, exactly as a broken W paired with
a healthy X does. So the gateway asks, in three steps along a streak of W's inconclusive pairs
with X (`_Streak`: since W last served a pair, all with X):

  suspect  W failed with X `SUSPECT_ROUNDS` times, X serving pairs with other workers between
           W's failures (a failure with no such pair in between is not counted: X may have been
           down then).
  probe    W is avoided where the pool can do without it (`suspected`, `pd._avoid_suspects`),
           so X's pairs with other workers come first in their requests: `PROBES` of them in a
           row served in a request's first round pass the test (a first round: X failing every
           other pair serves every retry). X leaving the pool clears W: nothing can probe it.
  retrial  W is no longer avoided, and its next failure with X (X having served since) convicts
           it: its breaker counts each round of the streak, then each later one.

Any of these clears W: a pair it serves; a failure of X paired inconclusively, since the streak
began, with another worker that works: it has served a pair since, or had served one within
`WITHIN_S` before and failed so with none since (X fails without W, in whichever order within a
request; a worker that never serves may be broken as W is, and two broken workers sharing their
one partner would otherwise clear each other for ever); W failing so with two partners that work
in one request (not one partner's case); `WITHIN_S` with no failure of W with X. So X failing
every other pair fails the first probe; X that had a bad spell and recovered serves the retrial
with W; X with no other partner (one prefill and one decode worker) serves only with W, which
clears W; and X failing a share f of its pairs at random gets W convicted only if W failed four
times and X passed 32 probes in a row between the last two: of W's streaks (each begun by a
failure) at most f³(1 − f)³² < 4e-5, each ending in a breaker opened for one cooldown (the
simulation in `tests/gateway/pd_blame_sim.py`, 22 million requests through pools of three to
five workers with one partner flapping at f from 0.05 to 0.3, beside broken or overloaded
workers or not: 11 of them). A pool that serves fewer than `PROBES` such pairs of X within
`WITHIN_S` never convicts W, which it then tries again a window after its last failure. A broken
W costs `SUSPECT_ROUNDS` + 1 rounds, then its breaker keeps it out (prefill/decode pools send
no canaries, so client requests are its half-open trials, and `failure_threshold` of them failed
in a row open it again: `CircuitBreaker`, "The half-open trial"; a trial fails when another
worker serves the request or none other is tried for the leg it played, a prefill leg comparing
nothing with an answering one (a decode leg or a whole attempt), whatever the workers' roles,
`outcome.HeldVerdicts.alone`; a failure weighed here is a verdict on a closed breaker only, none
once the breaker has left it). The rule holds in any pool, for a worker whose failures so are all
with one partner that works (two pairs always tried in the same order, say); with two or more,
triangulation weighs it.

An overloaded decode worker's 503 or 529 is not inconclusive: it took no part in the transfer,
and is its own (`pd_legs.decode_leg`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass

from gateway.breaker import BreakerState
from gateway.worker import Worker
from policies.base import WorkerId
from policies.records import record

WITHIN_S = 60.0  # how recent a served pair, or a failed one, must be to count
SUSPECT_ROUNDS = 3  # one partner: a worker's failures with it before that partner is probed
PROBES = 32  # one partner: the partner's pairs served without the suspect before its retrial
_MAX_WORKERS = 4096  # workers remembered (a pool's, with discovery's churn); then the stale go
_MAX_PARTNERS = 64  # partners remembered per worker; then the oldest go


@record
class Suspects:
    """The workers an SGLang pair goes without where the pool can (the one-partner probe)."""

    prefill: frozenset[WorkerId]
    decode: frozenset[WorkerId]


NO_SUSPECTS = Suspects(frozenset(), frozenset())


@dataclass(slots=True)
class _Failed:
    """A worker's inconclusive pairs with one partner: the first within `WITHIN_S`, the last,
    and the last that the partner had served a pair before, with no such failure in between."""

    first_s: float
    last_s: float
    worked_s: float


@dataclass(slots=True)
class _Streak:
    """A worker's inconclusive pairs since it last served one, all with `partner`."""

    worker: Worker
    partner: WorkerId
    prefill: bool  # the worker's part in the pairs
    since_s: float  # the first
    last_s: float  # the last
    rounds: int = 1  # the first, and each later one that came after `partner` served a pair
    probes: int = 0  # pairs `partner` served with others, in a first round, since the last
    convicted: bool = False


class InconclusivePairs:
    """When each of a pool's workers last served a pair, with whom each failed one
    inconclusively, and the one-partner streaks (`_Streak`) with those on probe.

    Invariant: every suspect is the streak of its worker, with at least `SUSPECT_ROUNDS`
    rounds, fewer than `PROBES` probes, and not convicted (`check_invariants`)."""

    __slots__ = ("_failed", "_served", "_streaks", "_suspects")

    def __init__(self) -> None:
        self._served: dict[WorkerId, float] = {}
        # worker -> partner -> its failures with it, the latest last
        self._failed: dict[WorkerId, dict[WorkerId, _Failed]] = {}
        self._streaks: dict[WorkerId, _Streak] = {}
        self._suspects: dict[WorkerId, _Streak] = {}  # the streaks on probe

    def served(self, prefill: WorkerId, decode: WorkerId, now_s: float, *, first_round: bool = False) -> None:
        """A pair of `prefill` and `decode` served a request (`first_round`: its first): both
        work, their streaks end, and in a first round the pair is a probe for either's suspects."""
        served = self._served
        if len(served) >= _MAX_WORKERS and (prefill not in served or decode not in served):
            self._served = served = {w: t for w, t in served.items() if now_s - t < WITHIN_S}
        served[prefill] = served[decode] = now_s
        if not self._streaks:
            return
        self._end(prefill)
        self._end(decode)
        if not first_round or not self._suspects:
            return
        for worker, streak in list(self._suspects.items()):
            if streak.partner != (decode if streak.prefill else prefill):
                continue
            if self._cleared(streak, now_s):
                self._end(worker)
                continue
            streak.probes += 1
            if streak.probes >= PROBES:
                del self._suspects[worker]  # passed: on to its retrial

    def note(self, prefill: Worker, decode: Worker, now_s: float) -> list[Worker]:
        """`note_request` for a request with one such pair."""
        return self.note_request([(prefill, decode)], now_s)

    def note_request(self, pairs: Sequence[tuple[Worker, Worker]], now_s: float) -> list[Worker]:
        """The (prefill, decode) pairs that failed pointing at neither worker in one request,
        since served: count them together, in whichever order they failed, and blame (failures
        on the breaker unless open) each worker they show at fault, once a round."""
        distinct = list({(p.worker_id, d.worker_id): (p, d) for p, d in pairs}.values())
        # Who worked before this request, read before its failures are counted: a partner's
        # failure with such a worker clears a streak (`_failed_elsewhere`), whichever came first.
        worked = {w.worker_id for pair in distinct for w in pair if self._worked_before(w.worker_id, now_s)}
        for p, d in distinct:
            self._pair_failed(p.worker_id, d.worker_id, now_s, d.worker_id in worked)
            self._pair_failed(d.worker_id, p.worker_id, now_s, p.worker_id in worked)
        # Each worker's partners in this request that work (`_works_with`): a failure with one
        # that does not says nothing of the worker, in the one-partner rule as in triangulation.
        partners: dict[WorkerId, set[WorkerId]] = {}
        for p, d in distinct:
            for one, other in ((p.worker_id, d.worker_id), (d.worker_id, p.worker_id)):
                if self._works_with(one, other, now_s):
                    partners.setdefault(one, set()).add(other)
        rounds: dict[WorkerId, int] = {}
        for p, d in distinct:
            for worker, partner, prefill in ((p, d.worker_id, True), (d, p.worker_id, False)):
                working = partners.get(worker.worker_id, set())
                if partner not in working:
                    continue
                if len(working) > 1:
                    self._end(worker.worker_id)  # two partners in one request: not one's case
                else:
                    rounds[worker.worker_id] = self._streak(worker, partner, prefill, now_s)
        blamed: list[Worker] = []
        for pair in pairs:
            for worker in pair:
                failures = rounds.pop(worker.worker_id, 0)
                if self._at_fault(worker.worker_id, now_s):
                    # Triangulation counts its rounds from now: no probe, nor a round counted twice.
                    self._end(worker.worker_id)
                    failures = max(failures, 1)
                if failures:
                    _blame(worker, failures, now_s)
                    blamed.append(worker)
        return blamed

    def suspected(self, now_s: float, pool: Container[WorkerId]) -> Suspects:
        """The workers on probe: an SGLang pair goes without them where the pool can. `pool`:
        its workers now; a suspect whose partner left it is cleared (nothing can probe it)."""
        if not self._suspects:
            return NO_SUSPECTS
        prefill: list[WorkerId] = []
        decode: list[WorkerId] = []
        for worker, streak in list(self._suspects.items()):
            if streak.partner not in pool or worker not in pool or self._cleared(streak, now_s):
                self._end(worker)
            else:
                (prefill if streak.prefill else decode).append(worker)
        return Suspects(frozenset(prefill), frozenset(decode))

    def check_invariants(self) -> None:
        for worker, streak in self._suspects.items():
            assert self._streaks.get(worker) is streak
            assert streak.rounds >= SUSPECT_ROUNDS and streak.probes < PROBES and not streak.convicted
        assert all(len(partners) <= _MAX_PARTNERS for partners in self._failed.values())

    def _streak(self, worker: Worker, partner: WorkerId, prefill: bool, now_s: float) -> int:
        """`worker` failed with `partner`: extend its streak, or begin one. Returns the failures
        to count on its breaker (none unless convicted)."""
        w = worker.worker_id
        if self._served.get(w, -math.inf) >= now_s:
            return 0  # it served this very request, after this failure
        streak = self._streaks.get(w)
        if streak is not None and (streak.partner != partner or self._cleared(streak, now_s)):
            self._end(w)
            streak = None
        if streak is None:
            streak = _Streak(worker, partner, prefill, now_s, now_s)
            if not self._failed_elsewhere(streak):  # else the partner fails with others now
                self._begin(streak, now_s)
            return 0
        partner_worked = self._served.get(partner, -math.inf) >= streak.last_s
        streak.last_s = now_s
        if not partner_worked:
            return 0
        streak.rounds += 1
        if streak.convicted:
            return 1
        if streak.probes >= PROBES:
            streak.convicted = True
            return streak.rounds
        streak.probes = 0
        if streak.rounds >= SUSPECT_ROUNDS:
            self._suspects[w] = streak
        return 0

    def _begin(self, streak: _Streak, now_s: float) -> None:
        streaks = self._streaks
        if len(streaks) >= _MAX_WORKERS:
            self._streaks = streaks = {w: s for w, s in streaks.items() if now_s - s.last_s < WITHIN_S}
            self._suspects = {w: s for w, s in self._suspects.items() if w in streaks}
        streaks[streak.worker.worker_id] = streak

    def _end(self, worker: WorkerId) -> None:
        if self._streaks.pop(worker, None) is not None:
            self._suspects.pop(worker, None)

    def _cleared(self, streak: _Streak, now_s: float) -> bool:
        return now_s - streak.last_s >= WITHIN_S or self._failed_elsewhere(streak)

    def _failed_elsewhere(self, streak: _Streak) -> bool:
        """Whether the streak's partner failed inconclusively, since the streak began, with
        another worker that has served a pair since (so it works: two workers broken alike, that
        only ever fail with their one partner, do not clear each other)."""
        partners = self._failed.get(streak.partner)
        if not partners:
            return False
        worker = streak.worker.worker_id
        for other, failed in partners.items():
            if other != worker and self._worked_s(other, failed) >= streak.since_s:
                return True
        return False

    def _worked_s(self, worker: WorkerId, failed: _Failed) -> float:
        """The latest of `worker`'s failures in `failed` (with one partner) that it has served a
        pair since, or had served one before with no such failure in between; -inf for none."""
        served = self._served.get(worker, -math.inf)
        if served >= failed.last_s:
            return failed.last_s
        return max(failed.worked_s, failed.first_s if served >= failed.first_s else -math.inf)

    def _worked_before(self, worker: WorkerId, now_s: float) -> bool:
        """Whether `worker` served a pair lately, and since its last inconclusive one."""
        served = self._served.get(worker)
        if served is None or now_s - served >= WITHIN_S:
            return False
        partners = self._failed.get(worker)
        return not partners or served >= next(reversed(partners.values())).last_s

    def _pair_failed(self, worker: WorkerId, partner: WorkerId, now_s: float, worked: bool) -> None:
        failed = self._failed
        if len(failed) >= _MAX_WORKERS and worker not in failed:
            self._failed = failed = {
                w: p for w, p in failed.items() if any(now_s - f.last_s < WITHIN_S for f in p.values())
            }
        partners = failed.setdefault(worker, {})
        found = partners.pop(partner, None)
        # The first failure of the pair within the window: the partner works if it served since.
        first_s = found.first_s if found is not None and now_s - found.first_s < WITHIN_S else now_s
        worked_s = now_s if worked else -math.inf if found is None else found.worked_s
        partners[partner] = _Failed(first_s, now_s, worked_s)
        if len(partners) > _MAX_PARTNERS:
            del partners[next(iter(partners))]

    def _works_with(self, worker: WorkerId, partner: WorkerId, now_s: float) -> bool:
        """Whether `partner` has served a pair since it first failed inconclusively with `worker`
        within `WITHIN_S` (one that has not, or served only before, may be broken: its failure
        with `worker` is its own as much as the worker's)."""
        failed = self._failed.get(worker, {}).get(partner)
        if failed is None or now_s - failed.first_s >= WITHIN_S:
            return False
        return self._served.get(partner, -math.inf) >= failed.first_s

    def _at_fault(self, worker: WorkerId, now_s: float) -> bool:
        """Whether `worker` failed, lately, paired with two or more workers that have served a
        pair since their first such failure (one that served only before may have broken)."""
        partners = self._failed.get(worker)
        if partners is None or len(partners) < 2:
            return False
        return sum(self._works_with(worker, partner, now_s) for partner in partners) >= 2


def _blame(worker: Worker, failures: int, now_s: float) -> None:
    """`failures` on the worker's breaker, none once it is open (a verdict is not stretched over
    an open breaker's cooldown)."""
    breaker = worker.breaker
    for _ in range(failures):
        if breaker.state(now_s) is BreakerState.OPEN:
            break
        breaker.on_failure(now_s, trial=None)
