"""Closing the books on one request: load accounting, quota, policy feedback, metrics, one log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admitted import Admitted
from gateway.answer_usage import NO_USAGE, Usage
from gateway.breaker import TrialTicket
from gateway.leg import Leg
from gateway.request_head import RequestIds
from gateway.routing import Routing
from gateway.tracing import AttemptTrace
from gateway.worker import Worker
from policies.base import Observation, Outcome, RouteDecision

log = logging.getLogger("kvgate.outcome")

# The access line's `error` for a request whose client left before its answer (status 499).
CLIENT_DISCONNECTED = "client_disconnected"


@dataclass(slots=True)
class Attempt:
    """One dispatch of an admitted request to one worker; `end` closes it (exactly once)."""

    admitted: Admitted
    worker: Worker
    reason: str
    dispatched_s: float
    decision: RouteDecision
    ttft_s: float | None = None
    finished: bool = False
    trace: AttemptTrace | None = None  # the attempt's CLIENT span, with tracing on
    body: bytes | None = None  # a prefill/decode leg's own body (gateway/pd.py); else the request's
    first_leg_s: float | None = None  # a split's decode leg: when its round's first leg was dispatched
    trial: TrialTicket | None = None  # the worker's half-open trial its dispatch took (`Worker.acquire`)
    leg: Leg = Leg.WHOLE  # the part it plays: a split's legs are `gateway.pd_pairs`'

    def __post_init__(self) -> None:
        self.admitted.attempt_started(own_body=self.body is not None)

    def request_body(self) -> bytes:
        """The bytes this attempt sends: its own body, or the request's for its decision."""
        return self.body if self.body is not None else self.admitted.body_for(self.decision)

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.dispatched_s
            self.worker.first_token(
                self.admitted.route.n_prompt_tokens,
                self.admitted.max_output_tokens,
                matched_tokens=self.decision.matched_tokens,
                now_s=self.dispatched_s + self.ttft_s,
            )

    def request_ttft_s(self) -> float | None:
        """The request's time to first token as the access line and the TTFT histogram count it:
        from this attempt's dispatch, or for a split's decode leg from its round's first leg's
        (`first_leg_s`), so that the prompt's computation on the prefill worker is in it."""
        if self.ttft_s is None or self.first_leg_s is None:
            return self.ttft_s
        return self.ttft_s + self.dispatched_s - self.first_leg_s

    def _release(self) -> bool:
        """Give back the worker's load exactly once; False if the attempt was already closed."""
        if self.finished:
            return False
        self.finished = True
        a = self.admitted
        self.worker.release(
            a.route.n_prompt_tokens,
            a.max_output_tokens,
            prefill_done=self.ttft_s is not None,
            matched_tokens=self.decision.matched_tokens,
        )
        return True

    def end(
        self, routing: Routing, outcome: Outcome, usage: Usage = NO_USAGE, *, judged: bool = True
    ) -> None:
        """Close the attempt, once (later calls do nothing): give back the worker's load, tell its
        breaker and the policy. SERVED is a success; WORKER_FAILED (connect error, 5xx, timeout,
        broken or malformed answer) is the only outcome that counts against the worker; REJECTED
        (the worker's 4xx) and ABORTED (the client left, or the gateway gave up) free a breaker
        trial without a verdict. No outcome but SERVED teaches the policy what the worker caches.
        `judged` False gives the breaker no verdict now (a trial is freed): the failure is held
        (`Failure.held`: a 5xx, a read timeout before the first byte, a worker's own error event
        in a stream), and counts later only if another worker serves the request (`HeldVerdicts`;
        a stream's never does: the client has it, no other worker is tried)."""
        if not self._release():
            return
        _slot_freed(routing, self.admitted.pool.name)
        now_s = time.monotonic()
        breaker = self.worker.breaker
        trial = self.trial
        if outcome is Outcome.SERVED:
            breaker.on_success(trial=trial)
        else:
            usage = NO_USAGE  # a worker's token counts are told to the policy only with a success
            if judged and outcome is Outcome.WORKER_FAILED:
                breaker.on_failure(now_s, trial=trial)
            else:
                breaker.on_abandon(trial=trial)
        routing.metrics.worker_outcome(self.admitted.pool.name, self.worker.url, outcome)
        if self.trace is not None:
            self.trace.end(outcome, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        _feedback(routing, self._observation(outcome, usage), now_s)

    def _observation(self, outcome: Outcome, usage: Usage) -> Observation:
        return Observation(
            request=self.admitted.route,
            worker=self.worker.worker_id,
            ttft_s=self.ttft_s,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            outcome=outcome,
        )


class Reservation:
    """A worker's slot held for a leg that is sent later (`Worker.reserve`): a vLLM pair's decode
    leg. Exactly one of `take` (the leg starts: its `Attempt` holds the slot from then on) and
    `give_back` (it will not be sent) takes effect; later calls do nothing. A slot given back is
    a freed slot to the pool's queue, as a closed attempt's is."""

    __slots__ = ("_held", "_max_output_tokens", "_trial", "worker")

    def __init__(self, worker: Worker, max_output_tokens: int, now_s: float) -> None:
        self.worker = worker
        self._max_output_tokens = max_output_tokens
        self._trial = worker.reserve(max_output_tokens, now_s)
        self._held = True

    def take(self) -> None:
        """The leg starts: the caller acquires the worker at once, in the same step."""
        if self._held:
            self._held = False
            self.worker.unreserve(self._max_output_tokens, self._trial)

    def give_back(self, routing: Routing, pool: str) -> None:
        if self._held:
            self.take()
            _slot_freed(routing, pool)


def _slot_freed(routing: Routing, pool: str) -> None:
    queue = routing.queues.get(pool)
    if queue is not None:
        queue.slot_freed()  # a request waiting for a slot of this pool may have it


class HeldVerdicts:
    """The workers whose failure on one request waits for the request's fate to show whose fault
    it was (`Failure.held`): a 5xx answer, or a read timeout before the first byte.

    A worker that answers is up, and the request itself may be what fails: one no worker can take
    would otherwise count against every worker it is retried on, and a tenant sending a few could
    open every breaker of the pool, for every tenant. A read timeout is no better evidence: vLLM
    sends nothing of a non-streamed answer until it is whole, so a long generation looks like a
    silent worker. So another worker serving the same request (its first event, or its whole
    answer) convicts them (`convict`: each counts as a failure), which still shuts out a hung or
    broken worker; another worker refusing it (a 4xx), or the request ending with no answer,
    acquits them (`acquit`), as does the client leaving.

    A request that ends with one worker's failure and nothing to compare it with is acquitted
    too, whatever left it alone: the client cut its retries (`retries.attempts_allowed`: an SDK's
    third try makes one attempt), the pool has `retry_attempts: 0`, a Responses follow-up could go
    only to its holder, or no other worker was free. What cuts a request to one attempt is in the
    client's hands, and vLLM answers 500 to some inputs (a `GenerationError`): counting such a 5xx
    whenever another worker was routable let one tenant convict the worker its request met, then
    the next, until one was left, for every tenant. Whether a peer was routable says nothing of
    whose fault the 5xx was; only a peer serving the request does.

    A worker's own error event in a stream (vLLM's `GenerationError` mid-answer, or in its first
    event; not a 4xx one, the request's fault) is such a failure, and always alone: the client
    has the stream, so no other worker is tried, and it counts against no worker, whatever the
    breaker's state (`streaming.ProxyStream`). Nor does a stream that starts with it serve the
    request: it convicts no held failure (`proxy.served`). A stream cut before `[DONE]`
    (connection lost, a malformed event) still counts at once: no client input causes that.

    A closed breaker's verdict is held, and a half-open breaker's client trial's
    (`CircuitBreaker.holds`): where no canary reaches the worker (prefill/decode pools, canaries
    off, a chat-only front end) client requests are the trials, and a tenant whose input every
    worker fails would otherwise re-open a recovered worker's breaker by winning its trials. The
    trial's slot is freed when its failure is held (a trial must not stay in flight for another
    worker's whole answer), and a conviction counts as a failed trial. A verdict is applied only
    in the breaker's spell it was held in (`CircuitBreaker.on_held_failure`): one that arrives
    after the breaker changed state (other requests opened it, its next trial closed it) is
    dropped rather than applied to a state it was not about. So, by its requests alone, a pool
    whose workers all answer every request with a 5xx, or all hang, opens no breaker, nor does a
    worker failing requests no other worker is tried on for its part (a pool's last routable
    worker, one with no retries), though such a worker's half-open breaker opens again after
    `failure_threshold` failed trials it was alone on (`acquit`); their requests still end (fast,
    or after `read_s`), a worker failing what others serve is still shut out once its requests
    are retried, and health checks still take down a worker that fails them (vLLM's `/health`
    fails when its engine is dead).

    An acquitted 5xx still leaves its worker suspected (`CircuitBreaker.suspect`), as does a
    worker's own error event in a stream: the gateway's canary, a request no client shapes, then
    decides (`gateway/canary.py`; pools without prefill/decode roles). So a worker answering
    5xx to everything, or ending every stream in its own error event, while its `/health`
    passes, is shut out whatever cuts its requests to one attempt, and a client's input that
    fails a healthy worker only costs that worker a canary. A read timeout leaves no suspicion:
    a canary's own timeout decides nothing (a busy worker is slow for every request), so it
    could not confirm one.
    """

    __slots__ = ("_answered", "_attempts", "_workers")

    def __init__(self, attempts: Sequence[Attempt]) -> None:
        self._attempts = attempts  # the request's, as they are made (`alone`)
        self._workers: list[tuple[Worker, int, Leg]] = []  # with the breaker's spell, and the leg
        self._answered: list[Worker] = []  # of `_workers`, those that answered with a 5xx

    def hold(self, worker: Worker, answered: bool = False, leg: Leg = Leg.WHOLE) -> None:
        """`worker` failed the request's `leg` with a held failure (a 5xx or a read timeout: either
        waits alike); `answered`: a 5xx (`Failure.answered`), which an acquittal leaves suspected."""
        self._workers.append((worker, worker.breaker.spell, leg))
        if answered:
            self._answered.append(worker)

    def alone(self, leg: Leg) -> bool:
        """Whether the request made one attempt of `leg`'s part, by the leg each played (`Leg`; a
        mixed worker plays either): an answer (a decode leg or whole) or a prefill leg, which
        compares nothing with an answer: a decode worker failing every leg must not stay half-open."""
        return sum(a.leg.answers is leg.answers for a in self._attempts) == 1

    def convict(self, now_s: float) -> None:
        for worker, spell, _ in self._workers:
            worker.breaker.on_held_failure(now_s, spell, compared=True)
        self._workers.clear()
        self._answered.clear()

    def acquit(self) -> None:
        """Nothing shows the held failures to be the workers': another worker refused the
        request, or it ends with no worker's answer (one worker's failure or several; no peer's
        state stands in for a peer's answer), or the client left. A worker that answered with a
        5xx is left suspected: a canary decides. A half-open trial that was its part's only
        attempt (`alone`) is a failed trial (`CircuitBreaker.on_held_failure`): a worker failing
        every request it alone is tried on for its part is kept out, as before trials were held;
        one that another worker also failed or refused in that part counts against none."""
        now_s = time.monotonic()
        for worker, spell, leg in self._workers:
            if self.alone(leg):
                worker.breaker.on_held_failure(now_s, spell, compared=False)
        for worker in self._answered:
            worker.breaker.suspect()
        self._workers.clear()
        self._answered.clear()


def _feedback(routing: Routing, obs: Observation, now_s: float) -> None:
    # A policy bug must not leak the request's quota slot or worker load: log and carry on.
    try:
        routing.policy.on_complete(obs, now_s)
    except Exception:
        log.exception("policy on_complete failed", extra={"request_id": obs.request.request_id})


def finish(
    routing: Routing,
    admitted: Admitted,
    attempt: Attempt | None,
    *,
    status: int,
    outcome: Outcome,
    retries: int,
    usage: Usage = NO_USAGE,
    error: str | None = None,
    error_detail: str | None = None,
    delivered_tokens: int | None = None,
    judged: bool = True,
) -> None:
    """Close the books on a request: its last attempt (unless already ended) and the request
    itself, once. `attempt` is None when no worker was tried. `error` is the error's code (the
    one the client got, or `client_disconnected`), `error_detail` its words (see `record_request`).
    `delivered_tokens` is a stream's count of the content events relayed (`sse.Relay`); `judged`
    False ends the attempt with no verdict on its worker (`Attempt.end`)."""
    if attempt is not None:
        trace = attempt.trace
        if trace is not None and error is not None and status != 499 and trace.error_type is None:
            # A stream that failed after its first event: its CLIENT span's `error.type` is the
            # code the client got in its error event (a 499's client got nothing: the outcome).
            trace.error_type = error
        attempt.end(routing, outcome, usage, judged=judged)
        if status == 200 and admitted.stream and not admitted.recorded:
            _time_per_output_token(routing, attempt, usage)
    record_request(
        routing,
        admitted,
        status=status,
        worker=attempt.worker if attempt is not None else None,
        reason=attempt.reason if attempt is not None else None,
        usage=usage,
        ttft_s=attempt.request_ttft_s() if attempt is not None else None,
        retries=retries,
        error=error,
        error_detail=error_detail,
        delivered_tokens=delivered_tokens,
    )


def _time_per_output_token(routing: Routing, attempt: Attempt, usage: Usage) -> None:
    """A streamed answer's decode time per output token after the first, as vLLM defines its
    `request_time_per_output_token_seconds` (seen from the gateway: first chunk to the end)."""
    tokens = usage.completion_tokens
    if tokens is None or tokens < 2 or attempt.ttft_s is None:
        return
    decode_s = time.monotonic() - attempt.dispatched_s - attempt.ttft_s
    routing.metrics.time_per_output_token(attempt.admitted.model, decode_s / (tokens - 1))


def record_request(
    routing: Routing,
    admitted: Admitted,
    *,
    status: int,
    worker: Worker | None,
    reason: str | None,
    usage: Usage,
    ttft_s: float | None,
    retries: int,
    error: str | None = None,
    error_detail: str | None = None,
    delivered_tokens: int | None = None,
) -> None:
    """Quota release, metrics, the access log line and (with tracing on) the SERVER span's
    attributes of an admitted request (once). The line's `error` is machine-readable (the error
    code), `error_detail` for people: the message the client got and, for a failed worker
    attempt, what the transport raised (`Failure.detail`); never request content.

    The completion tokens charged, counted and logged are the worker's `usage`, or a stream's
    `delivered_tokens` (the content events it relayed: one token or more each) when more: a
    stream that ended before its last usage (its client left, the worker failed) has none, or
    only Messages' opening count of 0, and a tenant could otherwise read all but the last token
    of every stream for its prompts alone. A whole answer cut before it arrived delivered
    nothing, and is charged nothing more."""
    a = admitted
    if a.recorded:
        return
    a.recorded = True
    if delivered_tokens and (usage.completion_tokens or 0) < delivered_tokens:
        usage = Usage(usage.prompt_tokens, delivered_tokens, usage.cached_tokens)
    now_s = time.monotonic()
    a.limiter.reconcile(a.route.n_prompt_tokens, usage.prompt_tokens, now_s)
    a.limiter.release(usage.completion_tokens or 0, now_s)
    duration_s = now_s - a.started_s
    routing.metrics.observe(
        model=a.model,
        tenant=a.tenant.name,
        endpoint=a.endpoint,
        status=status,
        duration_s=duration_s,
        ttft_s=ttft_s,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
    )
    # The access line's fields, built only when something reads them (the access log is off
    # below log level info, as in the overhead benchmark).
    access_log, tracer = routing.access_log, routing.tracer
    fields = None
    if access_log.enabled or tracer is not None:
        fields = {
            "request_id": a.request_id,
            "client_request_id": a.client_request_id,
            "tenant": a.tenant.name,
            "model": a.model,
            "endpoint": a.endpoint,
            "stream": a.stream,
            "status": status,
            "worker": worker.url if worker else None,
            "reason": reason,
            "retries": retries,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion_tokens,
            "ttft_ms": round(ttft_s * 1000, 2) if ttft_s is not None else None,
            "duration_ms": round(duration_s * 1000, 2),
            "error": error,
            "error_detail": error_detail,
            "drift_field": a.drift_field,
            "queue_ms": round(a.queued_s * 1000, 2) if a.queued_s is not None else None,
            "hold_ms": round(a.held_s * 1000, 2) if a.held_s is not None else None,
        }
        access_log.write(fields)
    if routing.decision_log is not None:
        routing.decision_log.finished(
            a.request_id,
            a.client_request_id,
            a.route,
            status=status,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            ttft_s=ttft_s,
        )
    if tracer is not None and fields is not None:
        tracer.record(fields)


def record_refusal(
    routing: Routing,
    ids: RequestIds,
    endpoint: str,
    started_s: float,
    *,
    status: int,
    error: str | None,
    tenant: str | None = None,
    model: str | None = None,
    stream: bool | None = None,
    worker: str | None = None,
) -> None:
    """The access line of a request the gateway refused or lost before admitting it, or of a
    stored-response request (`responses_routes.py`, which admits nothing): the same fields as
    `record_request`'s, those not known null. No `error_detail`: a refusal's message may quote
    the request; the code and the status say what was wrong. The API key is never logged, only
    the tenant it names. With tracing on, the same fields go on the request's SERVER span when
    it has one (a proxied route's), so it joins the line by `kvgate.request_id`."""
    fields = {
        "request_id": ids.internal,
        "client_request_id": ids.client,
        "tenant": tenant,
        "model": model,
        "endpoint": endpoint,
        "stream": stream,
        "status": status,
        "worker": worker,
        "reason": None,
        "retries": 0,
        "prompt_tokens": None,
        "cached_tokens": None,
        "completion_tokens": None,
        "ttft_ms": None,
        "duration_ms": round((time.monotonic() - started_s) * 1000, 2),
        "error": error,
        "error_detail": None,
        "drift_field": None,
        "queue_ms": None,
        "hold_ms": None,
    }
    routing.access_log.write(fields)
    if routing.tracer is not None:
        routing.tracer.record(fields)
