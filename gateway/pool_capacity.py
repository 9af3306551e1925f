"""How much room a pool's workers have left: routable workers and their free slots.

The pool's queue (`queueing.py`) asks this to tell a saturated pool, whose capacity will come
back, from one with no routable worker (an outage is not waited out), and how many turns to hand
out. A worker not judged yet (`Worker.coming`: just added, its first health checks under way)
counts as routable with no free slot: its capacity is about to come, so requests wait for it
rather than fail while discovery swaps a pool's workers. In a prefill/decode pool it counts
routes instead of workers: a split needs a slot on each of its two workers.
"""

from __future__ import annotations

from gateway.failure import Failure
from gateway.registry import Pool
from policies.base import Outcome, Role
from policies.pd import PdRoles

# Free slots counted for a routable worker without `max_in_flight_per_worker`.
UNCAPPED = 1 << 30


def capacity(
    pool: Pool, roles: PdRoles | None, now_s: float, splittable: bool = True, whole: bool = False
) -> tuple[int, int]:
    """(routable workers, free slots on them); in a prefill/decode pool, routes instead."""
    if roles is not None:
        if whole:
            return _role_capacity(pool, roles.whole, now_s)
        return _pair_capacity(pool, roles, now_s, splittable)
    routable = free = 0
    for worker in pool.workers.values():
        if not (worker.healthy and worker.breaker.allows(now_s)):
            routable += worker.coming(now_s)
            continue
        routable += 1
        cap = worker.max_in_flight
        if cap is None:
            free += UNCAPPED
        elif worker.in_flight < cap:
            free += cap - worker.in_flight
    return routable, free


def _role_capacity(pool: Pool, roles: frozenset[Role], now_s: float) -> tuple[int, int]:
    """(routable workers of `roles`, free slots on them): a request one of them serves alone."""
    routable = free = 0
    for worker in pool.workers.values():
        if Role.of(worker.role) not in roles:
            continue
        if worker.healthy and worker.breaker.allows(now_s):
            routable += 1
            cap = worker.max_in_flight
            free += UNCAPPED if cap is None else max(cap - worker.in_flight, 0)
        else:
            routable += worker.coming(now_s)
    return routable, free


def _pair_capacity(pool: Pool, roles: PdRoles, now_s: float, splittable: bool) -> tuple[int, int]:
    """(routes, routes whose workers all have a free slot). A worker that may serve a request
    alone is one route per slot; a split needs a slot on a prefill worker and one on a decode
    worker that is not also counted alone (SGLang's decode workers, which take only pairs).
    In vLLM's roles every decode worker serves alone too, so a full prefill side does not hold
    a request back: the pair chooser then runs it alone (`pd_alone_no_pair`)."""
    alone = prefill = paired = 0  # routable workers
    alone_free = prefill_free = paired_free = 0
    for worker in pool.workers.values():
        if worker.healthy and worker.breaker.allows(now_s):
            cap = worker.max_in_flight
            room = UNCAPPED if cap is None else max(cap - worker.in_flight, 0)
        elif worker.coming(now_s):
            room = 0
        else:
            continue
        role = Role.of(worker.role)
        if role in roles.alone:
            alone += 1
            alone_free += room
        elif role in roles.decode:
            paired += 1
            paired_free += room
        if role in roles.prefill:
            prefill += 1
            prefill_free += room
    if not splittable:
        return alone, alone_free
    return alone + min(prefill, paired), alone_free + min(prefill_free, paired_free)


def no_worker(pool: Pool, model: str, now_s: float) -> Failure:
    """The 503 of a request that no worker of `pool` took: its message says whether workers that
    are up were all at their cap (`max_in_flight_per_worker`, in a pool whose queue is off), which
    the client's retry can wait out, or none was routable."""
    for worker in pool.workers.values():
        cap = worker.max_in_flight
        if cap is not None and worker.in_flight >= cap and worker.healthy and worker.breaker.allows(now_s):
            message = f"every available worker for model '{model}' is at its request limit"
            break
    else:
        message = f"no healthy worker available for model '{model}'"
    return Failure(503, message, "no_worker_available", Outcome.ABORTED)
