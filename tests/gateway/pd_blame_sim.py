"""Requests through an SGLang P/D pool in virtual time, for who `gateway.pd_suspects` blames.

Each worker behaves as its `Behaviour` says; a pair fails inconclusively (the decode leg's 5xx
while the prefill leg is still out) when either worker of it does. A request runs as
`gateway.pd` runs it: the suspects avoided from its first round, up to `ROUNDS` rounds, each
without the workers of the request's inconclusive pairs where the pool can (`PdRun.avoiding`),
an overloaded decode worker (503) left out of the request; once a round serves it, the serving
pair is noted (`served`, a probe in a first round) and the request's inconclusive pairs weighed
(`note_request`). Breakers are the gateway's own, with the pool's default config. The policy
takes the first allowed worker of each role in a fixed order (`ordered`: the worst case of the
one-partner rule, one pair always tried first), one at random (`random`), or the first four
times in five and one at random otherwise (`sticky`, as cache affinity might).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.breaker import BreakerState
from gateway.config.pool import PoolConfig
from gateway.pd_suspects import InconclusivePairs, Suspects
from gateway.worker import Worker
from policies.base import WorkerId

ROUNDS = 3  # a pool's default retry_attempts (2), plus the first round
CONFIG = PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])


@dataclass(frozen=True, slots=True)
class Behaviour:
    """`healthy`; `flapping`: each pair it takes fails inconclusively with probability `f`;
    `broken`: every pair it takes does (a stuck prefill worker, a decode worker answering 500);
    `overloaded`: a decode worker answering 503 to a pair with probability `f` (its own
    failure, not an inconclusive one)."""

    kind: Literal["healthy", "flapping", "broken", "overloaded"] = "healthy"
    f: float = 0.0


HEALTHY = Behaviour()


class Blamer(Protocol):
    """`InconclusivePairs`' interface, as the gateway uses it (so variants can be compared)."""

    def served(
        self, prefill: WorkerId, decode: WorkerId, now_s: float, *, first_round: bool = ...
    ) -> None: ...

    def note_request(self, pairs: list[tuple[Worker, Worker]], now_s: float) -> list[Worker]: ...

    def suspected(self, now_s: float, pool: set[WorkerId]) -> Suspects: ...


@dataclass
class SimResult:
    """Requests served of those sent, inconclusive rounds, and per worker name: the rounds its
    breaker was blamed for, the times its breaker opened, the requests until it first opened."""

    requests: int = 0
    served: int = 0
    inconclusive_rounds: int = 0
    blamed: Counter[str] = field(default_factory=Counter)
    opened: Counter[str] = field(default_factory=Counter)
    first_open: dict[str, int] = field(default_factory=dict)


def simulate(
    behaviours: dict[str, Behaviour],
    requests: int,
    seed: int,
    *,
    policy: Literal["ordered", "random", "sticky"] = "ordered",
    rate_per_s: float = 10.0,
    blamer: Callable[[], Blamer] = InconclusivePairs,
) -> SimResult:
    """`behaviours` by worker name: p1, p2, ... prefill, d1, d2, ... decode."""
    rng = random.Random(seed)
    workers = {name: Worker(f"http://{name}:8000", CONFIG) for name in sorted(behaviours)}
    names = {w.worker_id: name for name, w in workers.items()}
    prefills = [w for name, w in workers.items() if name.startswith("p")]
    decodes = [w for name, w in workers.items() if name.startswith("d")]
    pool = set(names)
    pairs = blamer()
    result = SimResult()
    was_open = dict.fromkeys(workers, False)

    def fails(worker: Worker) -> bool:
        b = behaviours[names[worker.worker_id]]
        return b.kind == "broken" or (b.kind == "flapping" and rng.random() < b.f)

    def pick(candidates: list[Worker]) -> Worker | None:
        if not candidates:
            return None
        if policy == "ordered" or (policy == "sticky" and rng.random() < 0.8):
            return candidates[0]
        return rng.choice(candidates)

    for k in range(requests):
        now = k / rate_per_s
        result.requests += 1
        suspects = pairs.suspected(now, pool)
        avoided: tuple[set[WorkerId], set[WorkerId]] = (set(suspects.prefill), set(suspects.decode))
        excluded: set[WorkerId] = set()
        unsettled: list[tuple[Worker, Worker]] = []
        for round_ in range(ROUNDS):
            pair = _choose(now, prefills, decodes, excluded, avoided, pick)
            if pair is None:
                break
            p, d = pair
            trials = p.breaker.on_dispatch(now), d.breaker.on_dispatch(now)
            b = behaviours[names[d.worker_id]]
            if b.kind == "overloaded" and rng.random() < b.f:
                excluded.add(d.worker_id)  # its own 503: the verdict is its own, not counted here
                p.breaker.on_abandon(trial=trials[0])
                d.breaker.on_abandon(trial=trials[1])
                continue
            failed = [fails(p), fails(d)]  # each flapping worker fails on its own
            if any(failed):
                result.inconclusive_rounds += 1
                avoided[0].add(p.worker_id)
                avoided[1].add(d.worker_id)
                unsettled.append((p, d))
                p.breaker.on_abandon(trial=trials[0])
                d.breaker.on_abandon(trial=trials[1])
                continue
            result.served += 1
            p.breaker.on_success(trial=trials[0])
            d.breaker.on_success(trial=trials[1])
            pairs.served(p.worker_id, d.worker_id, now, first_round=round_ == 0)
            for worker in pairs.note_request(unsettled, now) if unsettled else []:
                result.blamed[names[worker.worker_id]] += 1
            break
        for name, worker in workers.items():
            is_open = worker.breaker.state(now) is BreakerState.OPEN
            if is_open and not was_open[name]:
                result.opened[name] += 1
                result.first_open.setdefault(name, k + 1)
            was_open[name] = is_open
    return result


def _choose(
    now: float,
    prefills: list[Worker],
    decodes: list[Worker],
    excluded: set[WorkerId],
    avoided: tuple[set[WorkerId], set[WorkerId]],
    pick: Callable[[list[Worker]], Worker | None],
) -> tuple[Worker, Worker] | None:
    """The round's pair, trying the avoided workers' sets in `PdRun.avoiding`'s order."""
    both = avoided[0] | avoided[1]
    for without in (both, avoided[1], avoided[0], set()) if both else (set(),):
        out = excluded | without
        p = pick([w for w in prefills if w.worker_id not in out and w.breaker.allows(now)])
        d = pick([w for w in decodes if w.worker_id not in out and w.breaker.allows(now)])
        if p is not None and d is not None:
            return p, d
    return None


def pool_of(shape: str, **behaviours: Behaviour) -> dict[str, Behaviour]:
    """Workers p1.. and d1.. of a "P:D" shape, healthy unless named."""
    n_prefill, n_decode = map(int, shape.split(":"))
    names = [f"p{i + 1}" for i in range(n_prefill)] + [f"d{i + 1}" for i in range(n_decode)]
    assert set(behaviours) <= set(names), behaviours
    return {name: behaviours.get(name, HEALTHY) for name in names}
