"""Dispatch in a prefill/decode pool (docs/pd.md, "Routing").

Each round asks the pool's `policies.pd.PdRouter` for a route, a pair or one worker alone, and
has `gateway.pd_pairs` send it in the pool's wire protocol. Failures lose nothing: a leg that
fails before the client has anything leaves its lesson on the run (a worker to avoid, no split
after a vLLM transfer failure) and a new round starts, up to the pool's `retry_attempts`; the
first round waits in the pool's queue, a retry does not.
"""

from __future__ import annotations

import asyncio
import time

from gateway.admitted import Admitted
from gateway.failure import Failure
from gateway.lifecycle import Lifecycle, shutting_down
from gateway.outcome import CLIENT_DISCONNECTED, Attempt, finish
from gateway.pd_pairs import PdRun, Response
from gateway.pd_requests import splittable
from gateway.pool_capacity import no_worker
from gateway.proxy import hold_for_peers, served
from gateway.responses_affinity import holder_unavailable, pinned_decision
from gateway.retries import advice, attempts_allowed
from gateway.routing import Routing
from gateway.transport import Transport
from policies.base import Outcome
from policies.pd import ALONE_UNSPLITTABLE, PdDecision, PdRouter

_ALONE_PREFIX = "pd_alone_"


async def dispatch_pd(
    a: Admitted, routing: Routing, transport: Transport, lifecycle: Lifecycle, attempts: list[Attempt]
) -> Response:
    """Route and send one request of a P/D pool; on any exception every leg still open is closed
    (the caller closes the request's books)."""
    router, pd = a.pool.pd_router, a.pool.config.pd
    assert router is not None and pd is not None
    # With vLLM a Responses request runs alone: its output budget (`max_output_tokens`) is not
    # one the prefill leg's rewrite caps, and vLLM's Responses route carries no KV transfer.
    responses_on_vllm = a.api.prompt == "responses" and pd.protocol == "vllm"
    # A route that does not generate (embeddings, scores, tokenizer, render, audio) has no KV
    # to move: it runs whole on a worker that serves it alone (`PdRoles.whole`).
    whole = not a.api.pd_split
    split = not (whole or responses_on_vllm) and splittable(a.forward)
    run = PdRun(a, routing, transport, lifecycle, attempts, pd, splittable=split, whole=whole)
    if split and pd.protocol == "sglang":
        _avoid_suspects(run)
    await hold_for_peers(a, routing)  # as in a pool without roles
    try:
        return await _rounds(run, router)
    except BaseException as exc:
        run.verdicts.acquit()
        await run.abandon()
        if isinstance(exc, asyncio.CancelledError):
            _left(run, lifecycle)
        raise


def _left(run: PdRun, lifecycle: Lifecycle) -> None:
    """The request's books when the client left or the drain deadline came during a round, as
    `proxy.dispatch` closes them, with the request's own retries (the failed legs that led to a
    new round; two legs of one round are no retry) and the last leg sent."""
    if lifecycle.ended_by_drain():
        err = shutting_down()
        status, code, detail = err.status, err.code, err.message
    else:
        status, code, detail = 499, CLIENT_DISCONNECTED, None
    last = run.attempts[-1] if run.attempts else None
    finish(
        run.routing,
        run.a,
        last,
        status=status,
        outcome=Outcome.ABORTED,
        retries=run.failures,
        error=code,
        error_detail=detail,
    )


async def _rounds(run: PdRun, router: PdRouter) -> Response:
    """Rounds until one answers the client or none is left; the last failure (or 503, no worker)
    is the request's answer, and the held verdicts on workers are given once."""
    a, routing = run.a, run.routing
    pool = a.pool
    # The client's own retries count against the pool's budget, as in `proxy._attempts`.
    rounds = 0  # rounds sent to workers
    skipped = False  # a request run alone is one skipped split, however many rounds that takes
    for n in range(attempts_allowed(pool.config.retry_attempts, a.retries_taken)):
        routed = await _choose(run, router, n == 0)
        if isinstance(routed, Failure):
            run.failure = routed  # the pool's queue turned it away
            break
        decision, now_s = routed
        if decision is None:
            break
        if run.retry_reason is not None:
            routing.metrics.retries.labels(pool.name, run.retry_reason).inc()
        if routing.decision_log is not None:
            views = pool.views(now_s, frozenset(run.excluded))
            transfer_s = router.settings.transfer_s(decision.transfer_tokens)
            routing.decision_log.decided_pd(
                a.request_id, a.route, decision, views, routing.policy, now_s, transfer_s
            )
        skipped = skipped or _count(run, decision)
        rounds += 1
        if decision.prefill is None:
            result = await run.alone(decision.decode)
        elif run.pd.protocol == "vllm":
            result = await run.vllm_pair(decision.prefill, decision.decode)
        else:
            result = await run.sglang_pair(decision.prefill, decision.decode)
        if result is not None:
            if served(result):
                run.verdicts.convict(time.monotonic())
                _settle_pairs(run, decision, first_round=rounds == 1)
            else:
                run.verdicts.acquit()  # a worker refused or failed the request: the likely cause
            return result
        if run.final or run.read_timeouts.spent:
            break
    run.verdicts.acquit()  # no worker served it: no held failure is shown to be a worker's
    failure = run.failure or no_worker(a.pool, a.model, time.monotonic())
    if a.pinned is not None:
        failure = holder_unavailable(run.failure)
    last = run.failed or (run.attempts[-1] if run.attempts else None)
    retries = max(run.failures - 1, 0)
    response = a.error_response(failure.error())
    finish(
        routing,
        a,
        last,
        status=response.status,  # the client's, as the route's envelope has it (`proxy._attempts`)
        outcome=failure.outcome,
        retries=retries,
        error=failure.code,
        error_detail=failure.detail(),
    )
    if not failure.says_whether_to_retry(run.only_later):
        response.headers += advice(rounds, pool.config.retry_attempts, a.retries_taken)
    return response


async def _choose(run: PdRun, router: PdRouter, first: bool) -> tuple[PdDecision | None, float] | Failure:
    """The round's route. The first waits in the pool's queue while no route has a free slot
    on its workers (`queueing.py`, as a mixed pool's first attempt); a retry does not."""
    a, routing = run.a, run.routing
    pool = a.pool
    excluded = frozenset(run.excluded)
    splittable, whole = run.splittable, run.whole
    if a.pinned is not None:
        # A Responses follow-up: only the worker holding its state can answer, alone (a request
        # that cannot be split, not one of a route that does not generate).
        now_s = time.monotonic()
        pinned = pinned_decision(a.pinned, pool.views(now_s, excluded))
        return (None if pinned is None else PdDecision(None, pinned, 0.0, ALONE_UNSPLITTABLE)), now_s

    def choose(now_s: float) -> PdDecision | None:
        for avoided in run.avoiding():
            views = pool.views(now_s, excluded | avoided)
            decision = router.select(
                routing.policy, a.route, views, now_s, splittable=splittable, whole=whole
            )
            if decision is not None:
                return decision
        return None

    queue = routing.queues.get(pool.name) if first else None
    if queue is None:
        now_s = time.monotonic()
        return choose(now_s), now_s
    routed = queue.try_pair(a, choose, splittable, whole=whole)
    return routed or await queue.wait_pair(a, choose, splittable, whole=whole)


def _avoid_suspects(run: PdRun) -> None:
    """An SGLang pair goes without the workers on probe where the pool can (`pd_suspects`: their
    partner's pairs with other workers come first), as without an inconclusive pair's."""
    pool = run.a.pool
    suspects = pool.pd_suspects.suspected(time.monotonic(), pool.workers)
    run.avoided[0].update(suspects.prefill)
    run.avoided[1].update(suspects.decode)


def _settle_pairs(run: PdRun, decision: PdDecision, first_round: bool) -> None:
    """The request was served: the SGLang pair that served it works (in the request's first
    round: a probe, `pd_suspects`), and its inconclusive pairs are weighed."""
    if run.pd.protocol != "sglang":
        return
    suspects = run.a.pool.pd_suspects
    now_s = time.monotonic()
    if decision.prefill is not None:
        suspects.served(decision.prefill.worker, decision.decode.worker, now_s, first_round=first_round)
    if run.unsettled:
        suspects.note_request(run.unsettled, now_s)


def _count(run: PdRun, decision: PdDecision) -> bool:
    """A worker alone where the route could have been split: a skipped split, with its reason
    (True: counted)."""
    metrics, pool = run.routing.metrics, run.a.pool.name
    if decision.prefill is not None or run.whole:
        return False
    if run.transfer_failed:
        reason = "transfer_failed"
        metrics.pd_transfer_outcomes.labels(pool, "recomputed").inc()
    else:
        reason = decision.reason.removeprefix(_ALONE_PREFIX)
    metrics.pd_skipped_splits.labels(pool, reason).inc()
    return True
