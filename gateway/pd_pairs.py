"""One round of a prefill/decode request: its legs, and what a failed leg leaves for the next round.

A round sends the route `gateway.pd` chose in the pool's wire protocol (`gateway.pd_legs`): one
worker alone; vLLM's legs one after the other (the prefill answer's `kv_transfer_params` go into
the decode leg); SGLang's both at once with the same bootstrap room. The client gets the decode
worker's answer, its `cached_tokens` the prefill worker's (the prefix-cache hit, not the
transfer); with SGLang the decode answer does not wait for the prefill answer, whose
`cached_tokens` count only if it has arrived in time (`PdRun._close_prefill`). The policy hears
of each leg as of any attempt: the prefill worker's completion teaches it that worker holds the
prompt, the decode worker's that it holds it too (it installed the KV it received).

A leg that fails before the client has anything is closed here and leaves the next round its
lesson (docs/pd.md, "Failures"):
- a prefill leg that fails (connect error, 5xx, timeout, malformed answer): without that worker;
- a decode worker unreachable or broken (under SGLang also its 5xx answer when its prefill leg
  was served within the connect timeout after it; its 503 or 529, overloaded): without that
  worker; its other 5xx while the prefill leg is still out points at neither: without both,
  and the pair is weighed once the request is served (`gateway.pd_suspects`);
- a transfer failure (a decode leg sent to read KV answered 5xx other than 503 and 529, under
  SGLang only when its prefill leg failed too, or an error event before its first token, or a
  stream that timed out before its first event): counted; vLLM then recomputes the request without
  a split (a decode or mixed worker alone); SGLang, whose decode workers take only paired requests,
  tries a fresh pair without the prefill worker whose KV did not arrive. A vLLM decode leg that had
  no KV to read (the prefill answer named none), and a whole decode answer that times out, fail as
  the decode worker's own.
Once the decode answer's first event has reached the client, a failure is the usual terminal
error event (`streaming.ProxyStream`). A leg refused with a 4xx is the request's fault and is
answered as it is. As in a pool without roles, a leg's 5xx or read timeout counts against its
worker only once another worker serves the request (`outcome.HeldVerdicts`), and a request's
second read timeout ends its rounds (`failure.ReadTimeouts`). A Responses request names a new
response in each round, the same on both legs (`Admitted.renew_response_id`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any
from urllib.parse import urlsplit

from gateway import proxy, whole_answer
from gateway.admitted import Admitted
from gateway.config.pd import PdConfig
from gateway.errors import RawResponse
from gateway.failure import Failure, ReadTimeouts
from gateway.leg import Leg
from gateway.lifecycle import Lifecycle
from gateway.outcome import Attempt, HeldVerdicts, Reservation
from gateway.pd_bodies import sglang_bodies, vllm_decode_body, vllm_prefill_body
from gateway.pd_legs import (
    Opened,
    Prefilled,
    Refused,
    TransferFailed,
    both_legs,
    decode_leg,
    deliver,
    prefill_leg,
)
from gateway.routing import Routing
from gateway.streaming import ProxyStream
from gateway.transport import Transport
from gateway.worker import Worker
from policies.base import Outcome, RouteDecision, WorkerId

Response = RawResponse | ProxyStream
log = logging.getLogger("kvgate.pd")


class PdRun:
    """One request's rounds: what failed so far, and the legs in flight. `splittable` says a
    round may still choose a pair (a transfer failure under vLLM clears it); `whole` that the
    route runs whole on one worker (it has no KV to move)."""

    def __init__(
        self,
        a: Admitted,
        routing: Routing,
        transport: Transport,
        lifecycle: Lifecycle,
        attempts: list[Attempt],
        pd: PdConfig,
        *,
        splittable: bool,
        whole: bool,
    ) -> None:
        self.a = a
        self.routing = routing
        self.transport = transport
        self.lifecycle = lifecycle
        self.attempts = attempts
        self.pd = pd
        self.excluded: set[WorkerId] = set()
        # Workers of an SGLang pair whose decode leg answered 5xx while its prefill leg was still
        # out: either may be at fault, so the next rounds go without both if they can, else
        # without one of them (`avoiding`); no verdict on either.
        self.avoided: tuple[set[WorkerId], set[WorkerId]] = (set(), set())
        self.unsettled: list[tuple[Worker, Worker]] = []  # those pairs, for `pd_suspects`
        self.inconclusive = False
        self.whole = whole
        self.splittable = splittable
        self.transfer_failed = False
        self.failure: Failure | None = None
        self.failed: Attempt | None = None  # the leg whose failure `failure` is
        self.retry_reason: str | None = None
        self.final = False
        self.failures = 0  # rounds in which a leg failed: the request's retries
        self.round_failed = False  # a leg of the round under way failed
        self.only_later = True  # every failed leg asked to be retried later (a worker's 503)
        # The workers whose 5xx or read timeout awaits the request's fate.
        self.verdicts = HeldVerdicts(self.attempts)
        self.read_timeouts = ReadTimeouts()  # past one, no further round (`failure.ReadTimeouts`)
        self.tasks: list[asyncio.Task[Any]] = []
        self.reserved: Reservation | None = None  # the decode slot of the vLLM pair in flight

    def avoiding(self) -> list[frozenset[WorkerId]]:
        """The workers a round goes without, besides `excluded`, in the order to try them: the
        inconclusive pairs' prefill and decode workers, their decode workers, their prefill
        workers, none."""
        prefills, decodes = self.avoided
        if not prefills and not decodes:
            return [frozenset()]
        return [frozenset(prefills | decodes), frozenset(decodes), frozenset(prefills), frozenset()]

    def _served(self, attempt: Attempt, role: str) -> None:
        """A leg's worker answered: its time to first token, when known."""
        if attempt.ttft_s is not None:
            self.routing.metrics.pd_ttft.labels(self.a.pool.name, role).observe(attempt.ttft_s)

    def _start(
        self,
        worker: Worker,
        decision: RouteDecision,
        body: bytes | None,
        leg: Leg,
        reserved: Reservation | None = None,
    ) -> Attempt:
        """Dispatch one leg: the policy, the worker's load and the metrics hear of it. The leg
        takes over `reserved`, the worker's slot held for it, if any."""
        a, routing = self.a, self.routing
        role = "alone" if leg is Leg.WHOLE else leg.value  # the metrics' label
        now_s = time.monotonic()
        routing.policy.on_dispatch(a.route, decision, now_s)
        routing.metrics.decision(routing.policy_name, decision.reason)
        routing.metrics.pd_requests.labels(a.pool.name, role).inc()
        if reserved is not None:
            reserved.take()
        trial = worker.acquire(a.route.n_prompt_tokens, a.max_output_tokens, now_s, decision.matched_tokens)
        attempt = Attempt(a, worker, decision.reason, now_s, decision, body=body, trial=trial, leg=leg)
        if routing.tracer is not None:
            attempt.trace = proxy.start_trace(routing, a, attempt)  # each leg's CLIENT span
        self.attempts.append(attempt)
        return attempt

    def _workers(self, *decisions: RouteDecision) -> list[Worker] | None:
        found = [self.a.pool.workers.get(d.worker) for d in decisions]
        if any(w is None for w in found):
            return None  # discovery removed a worker since the views were taken: choose again
        return [w for w in found if w is not None]

    def _failed(
        self,
        attempt: Attempt,
        failure: Failure,
        role: str,
        *,
        exclude: bool = True,
        outcome: Outcome | None = None,
    ) -> None:
        """A leg failed before the client had anything: close it (with `failure`'s outcome unless
        told otherwise) and try another round."""
        reason = failure.retry or failure.code
        self.routing.metrics.pd_leg_failures.labels(self.a.pool.name, role, reason).inc()
        if attempt.trace is not None:
            attempt.trace.error_type = reason
        held = failure.held and outcome is None
        if held and attempt.worker.breaker.holds(time.monotonic(), trial=attempt.trial):
            attempt.end(self.routing, failure.outcome, judged=False)
            self.verdicts.hold(attempt.worker, leg=attempt.leg)
        else:
            attempt.end(self.routing, outcome or failure.outcome)
        self.read_timeouts.note(failure)
        if not self.round_failed:  # both legs of an SGLang round may fail: one retry
            self.failures += 1
            self.round_failed = True
        self.only_later = self.only_later and failure.later
        if exclude:
            self.excluded.add(attempt.worker.worker_id)
        self.failure = failure
        self.failed = attempt
        self.retry_reason = failure.retry or "worker_error"

    def _prefill_failed(self, attempt: Attempt, failure: Failure) -> None:
        """A prefill leg failed: another pair is tried, without that worker, unless the failure is
        the gateway's own limit (the process's answer budget: aborted, no retry), which another
        pair would meet as well and which is no fault of the worker."""
        own_limit = failure.outcome is Outcome.ABORTED and failure.retry is None
        self._failed(attempt, failure, "prefill", exclude=not own_limit)
        if own_limit:
            self.final = True

    def _refused(self, attempt: Attempt, refused: Refused) -> Response:
        answer = whole_answer.answer(self.routing, self.a, attempt, refused.reply, self._retries())
        assert not isinstance(answer, Failure)  # a 4xx is always passed through
        return answer

    def _retries(self) -> int:
        return self.failures

    # -- one worker alone -----------------------------------------------------------------------

    async def alone(self, decision: RouteDecision) -> Response | None:
        self.round_failed = False
        workers = self._workers(decision)
        if workers is None:
            return None
        attempt = self._start(workers[0], decision, None, Leg.WHOLE)
        result = await proxy.send_attempt(
            self.routing, self.transport, self.lifecycle, self.a, attempt, self._retries()
        )
        if not isinstance(result, Failure):
            self._served(attempt, "alone")
            return result
        self._failed(attempt, result, "alone")
        self.final = result.retry is None  # the worker had begun answering: not sent twice
        return None

    # -- vLLM: prefill, then decode with what the prefill returned ------------------------------

    async def vllm_pair(self, prefill: RouteDecision, decode: RouteDecision) -> Response | None:
        """The decode worker's slot is the pair's from the start (`outcome.Reservation`): while
        the prefill leg runs, the pool's queue would otherwise see it free and send another
        request there, out of turn and past the worker's cap. Whatever ends the prefill leg
        without a decode leg (a refusal, a failure, the client leaving, the drain deadline, the
        decode worker leaving the pool meanwhile) gives the slot back."""
        self.round_failed = False
        workers = self._workers(prefill, decode)
        if workers is None:
            return None
        a, routing = self.a, self.routing
        a.renew_response_id()  # a new round: its legs name a new id, the same one
        slot = self.reserved = Reservation(workers[1], a.max_output_tokens, time.monotonic())
        p = self._start(workers[0], prefill, vllm_prefill_body(a, prefill), Leg.PREFILL)
        prefilled = await prefill_leg(routing, self.transport, a, p)
        if not isinstance(prefilled, Prefilled):
            slot.give_back(routing, a.pool.name)
            if isinstance(prefilled, Refused):
                return self._refused(p, prefilled)
            self._prefill_failed(p, prefilled)
            return None
        self._served(p, "prefill")
        if a.pool.workers.get(decode.worker) is not workers[1]:
            # Discovery removed the decode worker while the prefill leg ran: its slot goes back,
            # and the next round chooses again (the prompt is now cached where it was prefilled).
            slot.give_back(routing, a.pool.name)
            self.retry_reason = "worker_removed"
            return None
        body = vllm_decode_body(a, decode, prefilled.params)
        d = self._start(workers[1], decode, body, Leg.DECODE, slot)
        d.first_leg_s = p.dispatched_s  # the request's time to first token counts from here
        moved = prefilled.params is not None  # else the decode worker computes the prompt itself
        if moved:
            routing.metrics.pd_transfers.labels(a.pool.name).inc()
        result = await decode_leg(self.transport, a, d)
        since_s = d.dispatched_s if moved else None
        return self._decoded(d, result, prefilled.usage.cached_tokens, prefill.worker, since_s)

    # -- SGLang: both legs at once, meeting in a bootstrap room ---------------------------------

    async def sglang_pair(self, prefill: RouteDecision, decode: RouteDecision) -> Response | None:
        self.round_failed = False
        workers = self._workers(prefill, decode)
        if workers is None:
            return None
        a, routing = self.a, self.routing
        bootstrap = {
            "bootstrap_host": urlsplit(workers[0].url).hostname,
            "bootstrap_port": self.pd.bootstrap_port_of(workers[0].url),
            "bootstrap_room": secrets.randbits(63),
        }
        a.renew_response_id()  # a new round: its legs name a new id, the same one
        p_body, d_body = sglang_bodies(a, prefill, bootstrap)
        p = self._start(workers[0], prefill, p_body, Leg.PREFILL)
        d = self._start(workers[1], decode, d_body, Leg.DECODE)
        d.first_leg_s = p.dispatched_s  # the request's time to first token counts from here
        routing.metrics.pd_transfers.labels(a.pool.name).inc()
        p_task = asyncio.create_task(prefill_leg(routing, self.transport, a, p))
        d_task = asyncio.create_task(decode_leg(self.transport, a, d))
        self.tasks = [p_task, d_task]
        prefilled, opened = await both_legs(p_task, d_task, a.pool.config.timeouts.connect_s)
        self.tasks = []
        if isinstance(opened, Opened) and (not p_task.done() or isinstance(prefilled, Failure)):
            # The decode worker answered, so the KV arrived: its answer goes to the client now, as
            # SGLang's routers relay it, and the prefill leg is closed on its own.
            self._close_prefill(p, p_task, opened)
            # When the KV was ready is not known (the prefill answer is still to come): not timed.
            return self._decoded(d, opened, None, prefill.worker, d.dispatched_s, timed=False)
        if prefilled is None or isinstance(prefilled, Failure):
            # The prefill leg failed (or was stopped because the decode leg had).
            if isinstance(prefilled, Failure):
                self._prefill_failed(p, prefilled)
            else:
                p.end(routing, Outcome.ABORTED)
            if opened is None:
                d.end(routing, Outcome.ABORTED)
                return None
        if isinstance(prefilled, Refused):
            if isinstance(opened, Opened):
                opened.source.close()
            d.end(routing, Outcome.ABORTED)
            return self._refused(p, prefilled)
        if opened is None:
            return None
        self.inconclusive = isinstance(opened, TransferFailed) and opened.status and prefilled is None
        if self.inconclusive:
            self.avoided[1].add(d.worker.worker_id)
            self.unsettled.append((p.worker, d.worker))
        if isinstance(opened, TransferFailed) and opened.status and isinstance(prefilled, Prefilled):
            # The decode worker answered 5xx and its prefill leg was served, within the connect
            # timeout after it (`both_legs`): nothing points at the transfer, and an SGLang decode
            # worker that fails every request is otherwise never blamed (and its prefill worker
            # shut out instead). A prefill leg still out then (a prefill worker that hangs) leaves
            # it a failed transfer, blamed on no one and the prefill worker left out next round.
            opened = opened.failure
        cached = prefilled.usage.cached_tokens if isinstance(prefilled, Prefilled) else None
        since_s = d.dispatched_s  # the KV is ready to move once the prefill leg answered
        if isinstance(prefilled, Prefilled):
            self._served(p, "prefill")
            if p.ttft_s is not None:
                since_s = p.dispatched_s + p.ttft_s
        return self._decoded(d, opened, cached, prefill.worker, since_s)

    def _close_prefill(
        self, p: Attempt, task: asyncio.Task[Prefilled | Refused | Failure], opened: Opened
    ) -> None:
        """Read an SGLang prefill leg whose decode answer is already on its way to the client to
        its end (within the pool's read timeout, as any answer), apart from the request: served,
        its `cached_tokens` go into a stream's usage still to come; failed, it is closed with no
        verdict on its worker (the decode answer shows the KV arrived)."""
        self.routing.run_in_background(asyncio.create_task(self._prefill_closed(p, task, opened)))

    async def _prefill_closed(
        self, p: Attempt, task: asyncio.Task[Prefilled | Refused | Failure], opened: Opened
    ) -> None:
        try:
            result = await task
        except asyncio.CancelledError:  # the gateway stops: the leg's connection is closed
            p.end(self.routing, Outcome.ABORTED)
            raise
        except Exception:
            log.exception("prefill leg failed", extra={"request_id": self.a.request_id})
            p.end(self.routing, Outcome.ABORTED)
            return
        if not isinstance(result, Prefilled):
            p.end(self.routing, Outcome.ABORTED)
            return
        self._served(p, "prefill")
        relay = opened.relay
        if relay is not None and relay.cached_tokens is None:
            relay.cached_tokens = result.usage.cached_tokens

    # -- the decode leg's outcome ---------------------------------------------------------------

    def _decoded(
        self,
        d: Attempt,
        result: Opened | Refused | TransferFailed | Failure,
        cached: int | None,
        source: WorkerId,
        transfer_since_s: float | None,
        timed: bool = True,
    ) -> Response | None:
        """Hand an opened decode answer to the client, or account for the leg's failure.
        `transfer_since_s` is when the KV could start to move (None: no transfer was asked)."""
        metrics, pool = self.routing.metrics, self.a.pool.name
        if isinstance(result, TransferFailed) and transfer_since_s is None:
            result = result.failure  # no KV was to move: the decode worker failed on its own
        if isinstance(result, Opened):
            out = deliver(self.routing, self.lifecycle, self.a, d, result, cached, self._retries())
            if isinstance(out, Failure):  # a malformed whole answer: the decode worker's failure
                self._failed(d, out, "decode")
                return None
            if transfer_since_s is not None:
                metrics.pd_transfer_outcomes.labels(pool, "ok").inc()
                if timed and d.ttft_s is not None:
                    first_s = d.dispatched_s + d.ttft_s
                    metrics.pd_transfer_time.labels(pool).observe(max(0.0, first_s - transfer_since_s))
            self._served(d, "decode")
            return out
        if isinstance(result, Refused):
            return self._refused(d, result)
        if isinstance(result, TransferFailed):
            metrics.pd_transfer_failures.labels(pool, result.reason).inc()
            metrics.pd_transfer_outcomes.labels(pool, result.reason).inc()
            self.transfer_failed = True
            timed_out = result.reason == "timeout"
            # A decode worker that answered is not blamed for KV it could not get: its breaker gets
            # no verdict. One that timed out is not asked again, and is blamed as any read timeout
            # is (`outcome.HeldVerdicts`: once another worker serves the request).
            outcome = None if timed_out else Outcome.ABORTED
            self._failed(d, result.failure, "decode", exclude=timed_out, outcome=outcome)
            self.retry_reason = "transfer_failed"
            if self.pd.protocol == "vllm":
                self.splittable = False  # recompute the prompt where it is decoded
            else:
                # SGLang's decode workers serve only pairs: try another pair, without the prefill
                # worker whose KV did not arrive ("it might be dead"), or, when the decode worker
                # answered 5xx before the prefill leg ended, without either if the pool allows.
                if self.inconclusive:
                    self.avoided[0].add(source)
                else:
                    self.excluded.add(source)
            return None
        self._failed(d, result, "decode")
        self.final = result.retry is None  # the decode worker had begun answering: not sent twice
        return None

    async def abandon(self) -> None:
        """The request ends early (the client left, the drain deadline, or a bug): stop legs in
        flight, close their attempts (ABORTED: no verdict on the workers), give back a decode slot
        still held for a leg not sent."""
        if self.reserved is not None:
            self.reserved.give_back(self.routing, self.a.pool.name)
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks)
            for task in self.tasks:
                result = None if task.cancelled() or task.exception() else task.result()
                if isinstance(result, Opened):
                    result.source.close()
        for attempt in self.attempts:
            attempt.end(self.routing, Outcome.ABORTED)
