"""Canaries: the gateway's own request that confirms or clears a worker's uncompared failures.

A worker's 5xx answer, or its own error event in a stream, counts against it only when another
worker then serves the same request (`outcome.HeldVerdicts`): a client's input can cause either
(vLLM's 500 `GenerationError`), so a lone one is no verdict, else one tenant could open a pool's
breakers one after another. Such a failure leaves the worker suspected
(`CircuitBreaker.suspect`), and this module asks the worker itself, with a request no client
shapes:

    every CHECK_S, for each healthy worker (`/health`) of a pool without prefill/decode roles
    whose breaker is not open and has `breaker.canary` enabled:
        suspected, no canary in flight, the last sent `interval_s` ago or more → send one:
            POST /v1/completions {pool's base model, CANARY_PROMPT, max_tokens 1, stream}
            cut after `timeout_s`
        a 503 or 529 (an answer or the code of the worker's own error event), a 4xx, a timeout
            → inconclusive: nothing decided (a worker busy with other requests: its queue full,
            the canary preempted, back-pressure, all slow; how busy is in the clients' hands; a
            pool that serves no /v1/completions, a chat-only front end: its 404s leave its
            workers to requests retried elsewhere and health checks, as without canaries)
        another 5xx or refused credentials, the worker's own error event, a connection lost (one
            closed before any answer is first sent once more on a fresh connection: `probe`), a
            stream ended before [DONE] or malformed → failed: one failure on the breaker
            (`on_canary`), and the worker stays suspected, so the next follows an interval later
        [DONE] (or a whole answer: a JSON completion with its choices) → passed: the
            suspicions it answered for are cleared (a whole answer of another shape is malformed:
            failed)

A breaker that turns half-open leaves its worker suspected, so its next canary is the trial:
passed closes it, failed opens it again, and where canaries have reached the worker before no
client's request is let through meanwhile (`CircuitBreaker`, "The half-open trial"): a tenant
whose input fails a healthy worker cannot win that race and keep the breaker open. A canary
carries the breaker's spell it was sent in (`CanaryTicket`) to its verdict, which judges that
spell only: one sent before the breaker opened, answering once it is half-open, is no trial.

So a worker answering 5xx to everything, or ending every stream in its own error event, while
its `/health` passes, opens its breaker after `failure_threshold` failed canaries in a row
(whatever requests it serves between them: `CircuitBreaker.on_canary`), whatever cuts client
requests to one attempt (`retry_attempts: 0`, `x-stainless-retry-count`), and a tenant whose
input fails a healthy worker costs that worker one canary an interval, which passes. The canary
carries no tenant data (a fixed prompt, no salt, no client header), names itself to the worker
(`x-request-id: kvgate-canary-<n>`, User-Agent `kvgate-canary`), is not counted in the worker's
load, and is logged by pool, worker, verdict and what the verdict rests on (the worker's status,
whether it was the worker's own error event, an exception's class), never any content. At most
one canary is in flight per worker, each bounded by `timeout_s` and `MAX_CANARY_BYTES`; canaries
run in tasks this service owns, cancelled when their worker leaves its pool and when the gateway
stops.

Prefill/decode pools get none (their verdicts run through `pd_suspects.py`, and one leg alone
is not a request their workers answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import Mapping

import aiohttp
import orjson

from gateway.breaker import CanaryTicket
from gateway.failure import BUSY_STATUSES, REFUSED_CREDENTIALS, worker_failed
from gateway.registry import Pool, Registry
from gateway.sse import MalformedStream, SseRelay
from gateway.worker import Worker
from policies.base import WorkerId
from policies.records import record

log = logging.getLogger("kvgate.canary")

CANARY_PATH = "/v1/completions"
# Fixed and the gateway's own: no tenant's data ever goes into a canary.
CANARY_PROMPT = "Say OK."
# So that operators tell canaries apart in a worker's logs: `x-request-id: kvgate-canary-<n>`
# (n counts this process's canaries) and this User-Agent.
REQUEST_ID_PREFIX = "kvgate-canary-"
USER_AGENT = "kvgate-canary"
# How often the service looks for workers due a canary (or whose canary's worker left the pool).
CHECK_S = 0.25
# A one-token answer is a few hundred bytes; a worker sending more than this is not answering one.
MAX_CANARY_BYTES = 64 * 1024


class CanaryVerdict(enum.StrEnum):
    """What one canary showed (the label of its count and of its log line)."""

    PASSED = "passed"
    FAILED = "failed"
    INCONCLUSIVE = "inconclusive"


_PASSED = {CanaryVerdict.PASSED: True, CanaryVerdict.FAILED: False, CanaryVerdict.INCONCLUSIVE: None}


def canary_body(model: str) -> bytes:
    """The canary's request body: a one-token streamed completion of `CANARY_PROMPT`."""
    return orjson.dumps(
        {"model": model, "prompt": CANARY_PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    )


@record
class CanaryResult:
    """One canary's verdict and what it rests on, for its log line (never any content): the
    worker's HTTP `status`, or with `stream_error` the worker's own error event in the stream
    (`status`: the event's code, when it had one); `cause`: what else ended it (a transport
    exception's class, `timeout`, `too_large`, `malformed`: a whole answer that is no completion,
    `no_done`: the stream ended before `[DONE]`)."""

    verdict: CanaryVerdict
    status: int | None = None
    stream_error: bool = False
    cause: str | None = None

    @property
    def refused_credentials(self) -> bool:
        """The worker refused the gateway's credentials (the pool's worker key is wrong)."""
        return not self.stream_error and self.status in REFUSED_CREDENTIALS


async def probe(
    session: aiohttp.ClientSession, url: str, model: str, headers: Mapping[str, str], timeout_s: float
) -> CanaryResult:
    """Send one canary to the worker at `url` and judge its answer (module doc). A canary whose
    connection was closed before any byte of an answer is sent once more on a fresh connection:
    the shared session may have sent it on a kept-alive connection the worker was closing (uvicorn
    closes one idle for 5 s, the session keeps it 30 s), so the worker never saw it, as the lean
    client resends such a request (`gateway/upstream.py`). A worker that drops every connection
    still fails it: the fresh connection is dropped too."""
    try:
        async with asyncio.timeout(timeout_s):
            try:
                return await _judged(session, url, model, headers)
            except _Unanswered:
                async with _fresh_session() as fresh:
                    return await _judged(fresh, url, model, headers, last=True)
    except TimeoutError:
        return CanaryResult(CanaryVerdict.INCONCLUSIVE, cause="timeout")
    except (aiohttp.ClientError, OSError, MalformedStream) as exc:
        return CanaryResult(CanaryVerdict.FAILED, cause=type(exc).__name__)


async def _judged(
    session: aiohttp.ClientSession, url: str, model: str, headers: Mapping[str, str], *, last: bool = False
) -> CanaryResult:
    sent = {"content-type": "application/json", **headers}
    try:
        answered = await session.post(url + CANARY_PATH, data=canary_body(model), headers=sent)
    except aiohttp.ClientConnectorError:
        raise  # no connection was made: nothing to send again on a fresh one
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        if last:
            raise
        raise _Unanswered from None
    async with answered as resp:
        status = resp.status
        if status in BUSY_STATUSES:
            # Too busy for it (SGLang's "The request queue is full.", a preemption by a higher
            # priority request, uvicorn's --limit-concurrency, a proxy's 529): one tenant's load
            # can make a worker refuse every request so, which decides nothing, like a timeout.
            return CanaryResult(CanaryVerdict.INCONCLUSIVE, status)
        if worker_failed(status):
            return CanaryResult(CanaryVerdict.FAILED, status)
        if status >= 400:  # the worker refused it: it says nothing of the worker
            return CanaryResult(CanaryVerdict.INCONCLUSIVE, status)
        relay = SseRelay(False)
        streamed = resp.content_type == "text/event-stream"
        whole = bytearray()  # a whole answer's body (not a stream's)
        read = 0
        while chunk := await resp.content.readany():
            read += len(chunk)
            if read > MAX_CANARY_BYTES:
                return CanaryResult(CanaryVerdict.FAILED, status, cause="too_large")
            if streamed:
                relay.feed(chunk)
                if relay.error is not None or relay.done:
                    break
            else:
                whole += chunk
        if not streamed:
            if _completed(resp.headers.get("content-type", ""), bytes(whole)):
                return CanaryResult(CanaryVerdict.PASSED, status)  # a whole answer: it generated
            return CanaryResult(CanaryVerdict.FAILED, status, cause="malformed")
        if relay.error is not None:
            error = relay.error
            busy = error.worker_status in BUSY_STATUSES
            verdict = CanaryVerdict.INCONCLUSIVE if error.request_rejected or busy else CanaryVerdict.FAILED
            return CanaryResult(verdict, error.worker_status, stream_error=True)
        if relay.done:
            return CanaryResult(CanaryVerdict.PASSED, status)
        return CanaryResult(CanaryVerdict.FAILED, status, cause="no_done")


class Canaries:
    """The canaries of every pool's workers, while the app lifespan runs (`start` .. `stop`).
    Invariant: at most one task per worker URL in `_running` (a worker in two pools has one
    canary at a time, its verdict for the pool entry that sent it), and each is the canary of a
    worker its pool still holds, or is cancelled on the next check. `counts` keeps how many
    canaries ended with each verdict, and `by_worker` the same per (pool, worker URL, verdict),
    for the workers still in their pool (`forget_others`)."""

    def __init__(self, registry: Registry, session: aiohttp.ClientSession) -> None:
        self._registry = registry
        self._session = session
        self._running: dict[WorkerId, tuple[Pool, Worker, asyncio.Task[None]]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._sent = 0  # canaries sent by this process: the <n> of their request ids
        self.counts: Counter[CanaryVerdict] = Counter()
        self.by_worker: Counter[tuple[str, str, CanaryVerdict]] = Counter()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def start(self) -> None:
        if any(_takes_canaries(pool) for pool in self._registry.pools.values()):
            self._loop_task = asyncio.create_task(self._loop(), name="canaries")

    async def stop(self) -> None:
        tasks = [task for _, _, task in self._running.values()]
        if self._loop_task is not None:
            tasks.append(self._loop_task)
            self._loop_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._running.clear()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                self.check(time.monotonic())
            except Exception:  # a bug in one check must not end the canaries
                log.exception("canary check failed")

    def check(self, now_s: float) -> None:
        """Cancel the canaries of workers that left their pool; send those that are due to
        healthy workers."""
        for url, (pool, worker, task) in list(self._running.items()):
            if pool.workers.get(url) is not worker:
                task.cancel()
                del self._running[url]
        if self.by_worker:  # the counts of workers that left go too, scraped or not
            pools = self._registry.pools.values()
            self.forget_others({(pool.name, url) for pool in pools for url in pool.workers})
        for pool in self._registry.pools.values():
            if not _takes_canaries(pool):
                continue
            for worker in pool.workers.values():
                url = worker.worker_id
                # A worker its health check took down gets none (it stays suspected until it is
                # back): its canaries would fail on, a warning each, for as long as it is down.
                if url in self._running or not worker.healthy or not worker.breaker.canary_due(now_s):
                    continue
                sent = worker.breaker.canary_sent(now_s)
                self._sent += 1
                request_id = f"{REQUEST_ID_PREFIX}{self._sent}"
                canary = self._canary(pool, worker, request_id, sent)
                task = asyncio.create_task(canary, name=f"canary:{pool.name}")
                self._running[url] = (pool, worker, task)

    def forget_others(self, current: set[tuple[str, str]]) -> None:
        """Keep `by_worker` to the (pool, worker URL) pairs in `current`: a worker that left its
        pool takes its counts with it, as its other series go (bounded across worker churn)."""
        for key in [k for k in self.by_worker if (k[0], k[1]) not in current]:
            del self.by_worker[key]

    async def _canary(self, pool: Pool, worker: Worker, request_id: str, sent: CanaryTicket) -> None:
        try:
            timeout_s = pool.config.breaker.canary.timeout_s
            model = pool.config.base_model
            headers = {**pool.auth.headers, "x-request-id": request_id, "user-agent": USER_AGENT}
            result = await probe(self._session, worker.url, model, headers, timeout_s)
            verdict = result.verdict
            self.counts[verdict] += 1
            self.by_worker[pool.name, worker.url, verdict] += 1
            if pool.workers.get(worker.worker_id) is worker:
                # Its verdict judges the breaker's spell it was sent in only (`CanaryTicket`).
                worker.breaker.on_canary(_PASSED[verdict], time.monotonic(), sent=sent)
            _log(pool, worker, request_id, result)
        except Exception:  # a bug: the worker stays as it was, and may be sent another later
            log.exception("canary failed to run", extra={"pool": pool.name, "worker": worker.url})
        finally:
            entry = self._running.get(worker.worker_id)
            if entry is not None and entry[2] is asyncio.current_task():
                del self._running[worker.worker_id]


class _Unanswered(Exception):
    """The canary's connection was closed before any byte of an answer: on a kept-alive
    connection the worker was closing, the worker never saw it (`probe` sends it again)."""


def _fresh_session() -> aiohttp.ClientSession:
    """A session for one canary on a connection of its own, closed after it (never kept)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),  # as the shared session's
    )


def _completed(content_type: str, body: bytes) -> bool:
    """Whether a whole answer (not a stream) to the canary is a completion: a JSON object with
    its choices, of a JSON content type or none (as `whole_answer` takes a 200 on a JSON route).
    Anything else is malformed, a failure as it is for a client's request: a proxy's HTML page,
    an error object sent with a 200."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        return False
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    choices = parsed.get("choices") if isinstance(parsed, dict) else None
    return isinstance(choices, list) and bool(choices)


def _log(pool: Pool, worker: Worker, request_id: str, result: CanaryResult) -> None:
    """One line per canary: its verdict and what it rests on (`CanaryResult`), never content."""
    extra = {
        "pool": pool.name,
        "worker": worker.url,
        "request_id": request_id,
        "verdict": result.verdict.value,
        "status": result.status,
        "stream_error": result.stream_error,
        "cause": result.cause,
    }
    if result.refused_credentials:
        # Clients then get 503 no_worker_available once the breaker opens: say why here.
        message = "worker refused the gateway's credentials for its canary (check worker_api_key_*)"
        log.warning(message, extra=extra)
    elif result.verdict is CanaryVerdict.FAILED:
        log.warning("worker failed its canary", extra=extra)
    else:
        log.info("worker canary", extra=extra)


def _takes_canaries(pool: Pool) -> bool:
    return pool.config.pd is None and pool.config.breaker.canary.enabled
