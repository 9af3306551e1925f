"""Why an attempt on a worker failed, and what follows from it.

`failure_of` is the one place where the upstream transports' exceptions (the lean client's
`Upstream*` errors for http:// workers, aiohttp's for https workers, the relay's `MalformedStream`)
become the gateway's outcomes: the client's status, message and code, what the worker's breaker
and the policy learn, and whether the request may go to another worker.

What follows depends on how far the attempt got (`Stage`). A request is sent to another worker
only while nothing has reached the client and the worker had not begun delivering an answer: on a
connect error, a worker at its connection cap, a read timeout or a dropped connection before the
answer's head (for a stream: before its first event), a 5xx answer, or an answer that is not one
(a 200 whose body is not a JSON object, a stream whose first event is not an SSE data event with
a JSON object). The attempt that timed out is closed first, so the worker stops. Every failure
but the gateway's own limits (its connection cap per worker, its budget of whole answers held in
memory, its cap on one answer) counts against the worker; a 5xx and a read timeout before the
first byte count only once the request's fate shows whose fault they were (`Failure.held`,
`outcome.HeldVerdicts`). A read timeout sends the request to another worker once at most
(`ReadTimeouts`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import aiohttp
import orjson

from gateway.config.pool import TimeoutsConfig
from gateway.errors import WORKER_OVERLOADED, ApiError, error_type
from gateway.retries import forwardable
from gateway.sse import STREAM_ERROR_CODE, MalformedStream
from gateway.upstream import (
    MAX_ANSWER_BYTES,
    AnswerBudgetExceeded,
    AnswerTimeLimit,
    AnswerTooLarge,
    RetryHints,
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from policies.base import Outcome
from policies.records import record


class Stage(enum.Enum):
    """How far an attempt had got when it failed."""

    HEAD = "head"  # connecting, sending, or waiting for the answer's head
    FIRST_EVENT = "first_event"  # a stream's head came, its first event not: the client has nothing
    ANSWER = "answer"  # a whole (non-streamed) answer was arriving
    STREAM = "stream"  # the stream had reached the client


class RetryReason(enum.StrEnum):
    """Why a request was sent to another worker (the `reason` label of the retries counter)."""

    CONNECT_ERROR = "connect_error"
    WORKER_BUSY = "worker_busy"
    READ_TIMEOUT = "read_timeout"
    CONNECTION_LOST = "connection_lost"
    WORKER_ERROR = "worker_error"
    MALFORMED_ANSWER = "malformed_answer"


@record
class Failure:
    """An attempt's end without an answer for the client (or the queue's refusal of a request
    before any attempt, `queueing.py`). `retry` is set when the request may go to another worker;
    otherwise the client gets `status` with `message` and `code` (a stream that had reached the
    client gets them as its terminal error event)."""

    status: int
    message: str
    code: str
    outcome: Outcome
    retry: RetryReason | None = None
    retry_hints: RetryHints = ()  # the worker's Retry-After advice, forwarded with `status`
    # The worker answered with a 5xx: it is up, and the request may be the cause (see `held`).
    answered: bool = False
    # What the transport raised, for the logs only (`error_detail` of the access line): the
    # client's `message` says what happened in plain words, never a Python class name.
    cause: str | None = None
    param: str | None = None  # the request field the failure is about, as the client sees it
    # Retrying the request cannot change the answer: the client is told not to
    # (`x-should-retry: false`), whatever attempts its call has left.
    final: bool = False
    # The workers asked to be retried later (a 503 or a 529: overloaded or starting, no work spent
    # on the request): the client may retry after their `Retry-After`, whatever its call's budget.
    later: bool = False
    # The worker's own message in its error body (`worker_said`), for the client only: it may
    # quote the client's prompt, so it stays out of `detail()`, the logs and the spans.
    said: str | None = None

    def says_whether_to_retry(self, only_later: bool) -> bool:
        """Whether the answer's own advice stands, so the call's retry budget adds none
        (`retries.advice`): always for a `final` failure; for a `later` one only when every attempt
        of this try asked to be retried later (`only_later`): an attempt that cost a worker work
        (a 5xx, a read timeout) still spends the call's budget."""
        return self.final or (self.later and only_later)

    @property
    def held(self) -> bool:
        """Whether the worker's breaker verdict waits for the request's fate
        (`outcome.HeldVerdicts`): after a 5xx (the worker is up, and the request may be what
        fails) or a read timeout before the first byte (a hung worker, or a request that takes
        longer than `read_s` anywhere: a non-streamed answer is sent only once it is whole)."""
        return self.answered or self.retry is RetryReason.READ_TIMEOUT

    def error(self) -> ApiError:
        if self.final:
            headers = {"x-should-retry": "false"}
        else:
            headers = {name.decode(): value.decode() for name, value in forwardable(self.retry_hints)}
            if self.status == 503:
                headers.setdefault("retry-after", "1")
        message = self.message if self.said is None else f"{self.message}: {self.said}"
        # A 5xx is a `server_error`; the queue's 429 (`queueing.py`) a `rate_limit_error`, as
        # every other 429 of the gateway.
        return ApiError(self.status, message, error_type(self.status), self.code, self.param, headers)

    def detail(self) -> str:
        """The access line's `error_detail`: the client's message (less what the worker `said`),
        and what the transport raised."""
        return self.message if self.cause is None else f"{self.message}; {self.cause}"


# The read timeouts after which a request still goes to another worker (docs/gateway.md,
# "Retries and failed workers"): one shuts out a hung worker; every further one would mostly cost
# a long generation another worker's `read_s` of GPU time.
READ_TIMEOUT_RETRIES = 1


class ReadTimeouts:
    """One request's attempts that ended in a read timeout (`RetryReason.READ_TIMEOUT`): once
    there are more than `READ_TIMEOUT_RETRIES`, the request goes to no other worker."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def note(self, failure: Failure) -> None:
        if failure.retry is RetryReason.READ_TIMEOUT:
            self.count += 1

    @property
    def spent(self) -> bool:
        return self.count > READ_TIMEOUT_RETRIES


class FirstEventTimeout(TimeoutError):
    """A stream's first event did not come within `timeouts.first_event_s` of sending the request
    (`proxy.first_event_by`): a read timeout before the first byte, with its own bound."""


# Everything a transport (or the relay reading from it) raises for a worker's fault.
TRANSPORT_ERRORS = (UpstreamError, aiohttp.ClientError, OSError, MalformedStream)

_BAD_GATEWAY = "bad_gateway"
_TOO_LARGE = (
    f"the worker's answer is larger than the gateway relays in one answer ({MAX_ANSWER_BYTES >> 20} MiB):"
    " ask for less in one request (fewer inputs or choices, no logprobs), or stream it"
)
_TIMEOUT = "upstream_timeout"


def failure_of(exc: Exception, stage: Stage, timeouts: TimeoutsConfig) -> Failure:
    """The outcome of an attempt that raised `exc` (one of `TRANSPORT_ERRORS`) at `stage`."""
    if isinstance(exc, MalformedStream):
        return malformed(f"worker sent a malformed stream ({exc})", stage)
    if isinstance(exc, UpstreamBusy):
        # The gateway's own connection cap, not a worker fault: the breaker is not told, and the
        # client gets 503 with Retry-After when no other worker takes the request.
        message = f"worker at its connection limit ({exc})"
        return Failure(503, message, "no_worker_available", Outcome.ABORTED, RetryReason.WORKER_BUSY)
    if isinstance(exc, AnswerBudgetExceeded):
        # The gateway's memory, not the worker: no breaker verdict, and no other worker (the
        # budget is the process's); 503 with Retry-After, like the other gateway-wide limits.
        return Failure(503, f"{exc}; retry shortly", "gateway_overloaded", Outcome.ABORTED)
    if isinstance(exc, AnswerTooLarge):
        # What the request asked for, not the worker: no breaker verdict, no other worker (each
        # would answer the same), and no retry by the client.
        return Failure(502, _TOO_LARGE, "answer_too_large", Outcome.ABORTED, cause=str(exc), final=True)
    if isinstance(exc, AnswerTimeLimit):
        # The worker kept answering past the request's time limit: how long an answer takes is
        # what the request asked for, so no breaker verdict (a client could otherwise open a
        # pool's breakers with long answers) and no other worker (it would take as long).
        message = f"the answer took longer than the gateway's limit of {timeouts.total_s:g} s"
        return Failure(504, message, _TIMEOUT, Outcome.ABORTED, cause=str(exc), final=True)
    failed = Outcome.WORKER_FAILED
    cause = _cause(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError) or (
        isinstance(exc, UpstreamConnectError) and exc.timed_out
    ):
        message = f"could not connect to a worker within {timeouts.connect_s:g} s"
        return Failure(502, message, _BAD_GATEWAY, failed, RetryReason.CONNECT_ERROR, cause=cause)
    if isinstance(exc, UpstreamConnectError | aiohttp.ClientConnectorError):
        message = "could not reach a worker (connect failed)"
        return Failure(502, message, _BAD_GATEWAY, failed, RetryReason.CONNECT_ERROR, cause=cause)
    if stage is Stage.HEAD and isinstance(exc, UpstreamError) and exc.answered:
        # The lean client reads a whole answer in one call and says itself whether its head came.
        stage = Stage.ANSWER
    timed_out = isinstance(exc, TimeoutError | UpstreamTimeout)
    said = _plain(exc, timed_out)
    if stage is Stage.STREAM:
        return Failure(
            502, f"worker stream failed mid-answer ({said})", STREAM_ERROR_CODE, failed, cause=cause
        )
    if stage is Stage.ANSWER:
        if timed_out:
            message = "worker timed out while sending its answer"
            return Failure(504, message, _TIMEOUT, failed, cause=cause)
        return Failure(
            502, f"worker connection failed mid-answer ({said})", _BAD_GATEWAY, failed, cause=cause
        )
    if timed_out:
        if isinstance(exc, FirstEventTimeout):
            message = f"worker stream sent no event within {timeouts.first_event_s:g} s"
        else:
            message = f"worker did not answer within {timeouts.read_s:g} s"
        return Failure(504, message, _TIMEOUT, failed, RetryReason.READ_TIMEOUT, cause=cause)
    if stage is Stage.FIRST_EVENT:
        message = f"worker stream failed before its first event ({said})"
    else:
        message = f"could not reach a worker ({said})"
    return Failure(502, message, _BAD_GATEWAY, failed, RetryReason.CONNECTION_LOST, cause=cause)


def _cause(exc: Exception) -> str | None:
    """What the logs get beyond the client's message: a connect error's errno class (`connect
    failed (ConnectionRefusedError)`), another library's exception class; nothing for the lean
    client's other errors, whose words the message already quotes."""
    if isinstance(exc, UpstreamConnectError):
        return str(exc)
    return None if isinstance(exc, UpstreamError) else type(exc).__name__


def _plain(exc: Exception, timed_out: bool) -> str:
    """What went wrong in words a client reads: the lean client's own (`worker closed the
    connection`, `worker answer too large`); for another library's exception, whose name is
    for the logs only, what it amounts to."""
    if isinstance(exc, UpstreamError):
        return str(exc)
    return "timed out" if timed_out else "connection lost"


# A worker's 401 or 403 refuses the gateway's credentials, never the client's: a client's key
# ends at the gateway, and no credential can be among a pool's `forward_headers`.
REFUSED_CREDENTIALS = frozenset((401, 403))


def worker_failed(status: int, scale_out: bool = False) -> bool:
    """Whether a worker's answer of `status` is the worker's failure rather than its verdict on
    the request: a 5xx, or a refusal of the gateway's credentials (`REFUSED_CREDENTIALS`), except
    a 403 on a `scale_out` route (`routes.ApiRoute`), vLLM's answer that it does not serve it."""
    if status >= 500:
        return True
    return status in REFUSED_CREDENTIALS and not (scale_out and status == 403)


# A worker's 529 is Anthropic's "overloaded" (`overloaded_error`), which some servers and proxies
# in front of OpenAI-compatible engines send as well: the same word as a 503.
OVERLOADED = 529
# A worker's answers that say it is busy (for every request, not this one): 503 and 529.
BUSY_STATUSES = frozenset((503, OVERLOADED))


def says_why(status: int) -> bool:
    """Whether a worker's answer of `status` (`worker_failed`) reaches the client with the
    worker's own message (`worker_said`): a 5xx other than the overloaded ones (`BUSY_STATUSES`),
    which keep the gateway's words. vLLM answers a request it failed on with a 500 and a JSON
    error (`GenerationError`, an engine error), and only the worker's message says what it was."""
    return status >= 500 and status not in BUSY_STATUSES


# The most of a worker's error body read for its message (the rest is not waited for), and the
# most of its message a client gets.
ERROR_PREFIX_BYTES = 4096
WORKER_SAID_CHARS = 512


def worker_said(body: bytes | bytearray | memoryview, withhold: Callable[[bytes], bytes]) -> str | None:
    """The message of a worker's JSON error body, read from its first `ERROR_PREFIX_BYTES`:
    vLLM's `{"error": {"message": ...}}`, or its older `{"object": "error", "message": ...}`;
    passed through `withhold` (`Admitted.withhold_salts`: the message may quote the request), then
    cut to `WORKER_SAID_CHARS`: cut first, a salt across the cut would keep fewer of its characters
    than `withhold` looks for (`errors.MIN_SALT_RUN`), and they would reach the client. None for a
    body of another shape, or one longer than read."""
    try:
        parsed = orjson.loads(bytes(body[:ERROR_PREFIX_BYTES]))
    except orjson.JSONDecodeError:
        return None
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else None
    if not isinstance(message, str) or not message.strip():
        return None
    message = withhold(message.strip().encode()).decode(errors="replace")
    if len(message) > WORKER_SAID_CHARS:
        message = message[:WORKER_SAID_CHARS] + "..."
    return message


def worker_status(status: int, hints: RetryHints = (), said: str | None = None) -> Failure:
    """A worker answered 5xx or refused the gateway's credentials (`worker_failed`): another
    worker may take the request. When none does, a 503 (an overloaded or starting worker) reaches
    the client as a 503 with the worker's own `Retry-After`, and so does a 529 (overloaded), as
    `WORKER_OVERLOADED` (an Anthropic client gets its 529: `anthropic.error_response`); a refusal
    of credentials as a 502 `worker_auth_failed` (the client's key was fine: the pool's worker key
    is missing or wrong); any other 5xx as a 502, with the worker's own message when it gave one
    (`said`, from `worker_said`: `says_why`). Each waits for the request's fate before it counts
    against the worker (`Failure.held`)."""
    failed, retry = Outcome.WORKER_FAILED, RetryReason.WORKER_ERROR
    if status in REFUSED_CREDENTIALS:
        message = f"the worker refused the gateway's credentials (HTTP {status})"
        # Held like a 5xx: a proxy in front of the workers may refuse the request itself (a WAF),
        # and such a request must not open every worker's breaker.
        return Failure(502, message, "worker_auth_failed", failed, retry, answered=True)
    message = f"worker answered {status}"
    if status == 503:
        return Failure(503, message, "worker_unavailable", failed, retry, hints, answered=True, later=True)
    if status == OVERLOADED:
        message = f"worker answered {status} (overloaded)"
        return Failure(503, message, WORKER_OVERLOADED, failed, retry, hints, answered=True, later=True)
    return Failure(502, message, _BAD_GATEWAY, failed, retry, answered=True, said=said)


def malformed(message: str, stage: Stage) -> Failure:
    """A worker's answer that is not one: counted against the worker like a 5xx, and retried
    like one unless the stream had reached the client."""
    if stage is Stage.STREAM:
        return Failure(502, message, STREAM_ERROR_CODE, Outcome.WORKER_FAILED)
    return Failure(502, message, _BAD_GATEWAY, Outcome.WORKER_FAILED, RetryReason.MALFORMED_ANSWER)
