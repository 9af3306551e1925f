"""One failure map for both upstream transports: the lean client and aiohttp, driven against the
same scripted workers, fail the same way in the gateway's terms."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import pytest

from gateway.config.pool import TimeoutsConfig
from gateway.failure import (
    TRANSPORT_ERRORS,
    Failure,
    ReadTimeouts,
    RetryReason,
    Stage,
    failure_of,
    worker_status,
)
from gateway.sse import MalformedStream, first_event_problem
from gateway.upstream import UpstreamBusy, UpstreamError, UpstreamPool, UpstreamTimeout
from policies.base import Outcome
from tests.gateway.fake_upstream import Handler, Server, post, read_request
from tests.gateway.manual_clock import ManualClock
from tests.support.processes import free_port
from tests.support.wait import wait_until

TIMEOUTS = TimeoutsConfig(connect_s=1.0, read_s=1.0, total_s=10.0)
# A Python class name in a client's message ("ConnectionRefusedError", "UpstreamError").
CLASS_NAME = re.compile(r"[A-Z][A-Za-z]*(Error|Exception)\b")


@dataclass
class Silence:
    """Where a scripted worker fell silent: the answer's body bytes it had sent by then (None
    until it does, or if it never does)."""

    body_bytes: int | None = None


async def _lean(port: int, silence: Silence) -> Failure:
    """The lean client's read timeout on a clock that moves only here: once the worker fell
    silent and what it sent before has arrived, so no stall of the machine changes the stage."""
    clock = ManualClock()
    pool = UpstreamPool(sweep=clock.sweep)
    sent = asyncio.create_task(
        pool.post("127.0.0.1", port, post(), connect_s=1.0, read_s=TIMEOUTS.read_s, total_s=10.0)
    )
    try:
        await wait_until(lambda: sent.done() or silence.body_bytes == pool.budget.held_bytes)
        clock.advance(TIMEOUTS.read_s)
        await wait_until(sent.done, what="the request ended")
        sent.result()
    except TRANSPORT_ERRORS as exc:
        return failure_of(exc, Stage.HEAD, TIMEOUTS)
    finally:
        sent.cancel()
        pool.close()
    raise AssertionError("the request did not fail")


async def _aiohttp(port: int) -> Failure:
    """As the proxy drives aiohttp: the head first (Stage.HEAD), then the body (Stage.ANSWER).
    aiohttp's read timeout runs on the loop's clock: it is long enough that only a stall of the
    machine as long as it, before a stalling worker's first bytes arrive, changes the stage."""
    timeout = aiohttp.ClientTimeout(total=10.0, sock_connect=1.0, sock_read=TIMEOUTS.read_s)
    async with aiohttp.ClientSession() as session:
        stage = Stage.HEAD
        try:
            resp = await session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{}", timeout=timeout
            )
            stage = Stage.ANSWER
            await resp.read()
        except TRANSPORT_ERRORS as exc:
            return failure_of(exc, stage, TIMEOUTS)
    raise AssertionError("the request did not fail")


# A scripted worker: `Handler` with the `Silence` it notes where it falls silent in.
Scripted = Callable[[Silence, asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
PART = b"part"


async def _silent(
    silence: Silence, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
) -> None:
    await read_request(reader)
    silence.body_bytes = 0
    await reader.read()  # until the client gives up


async def _hangs_up(
    silence: Silence, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
) -> None:
    await read_request(reader)  # ... and the fixture closes the connection


async def _dies_mid_answer(
    silence: Silence, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
) -> None:
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + PART)
    await writer.drain()


async def _stalls_mid_answer(
    silence: Silence, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
) -> None:
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + PART)
    await writer.drain()
    silence.body_bytes = len(PART)
    await reader.read()


# scripted worker: status, code, outcome, retry reason, message prefix (both transports)
CASES: dict[str, tuple[Scripted | None, int, str, Outcome, RetryReason | None, str]] = {
    "refused": (
        None,
        502,
        "bad_gateway",
        Outcome.WORKER_FAILED,
        RetryReason.CONNECT_ERROR,
        "could not reach",
    ),
    "silent": (
        _silent,
        504,
        "upstream_timeout",
        Outcome.WORKER_FAILED,
        RetryReason.READ_TIMEOUT,
        "worker did not",
    ),
    "hangs_up": (
        _hangs_up,
        502,
        "bad_gateway",
        Outcome.WORKER_FAILED,
        RetryReason.CONNECTION_LOST,
        "could not reach",
    ),
    "dies_mid_answer": (
        _dies_mid_answer,
        502,
        "bad_gateway",
        Outcome.WORKER_FAILED,
        None,
        "worker connection failed",
    ),
    "stalls_mid_answer": (
        _stalls_mid_answer,
        504,
        "upstream_timeout",
        Outcome.WORKER_FAILED,
        None,
        "worker timed out",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_both_transports_fail_alike(serve: Callable[[Handler], Awaitable[Server]], case: str) -> None:
    handler, status, code, outcome, retry, message = CASES[case]
    silence = Silence()
    port = (await serve(functools.partial(handler, silence))).port if handler is not None else free_port()
    for failure in (await _lean(port, silence), await _aiohttp(port)):
        assert (failure.status, failure.code, failure.outcome, failure.retry) == (
            status,
            code,
            outcome,
            retry,
        )
        assert failure.message.startswith(message)
        # Plain words for the client; the transport's class names only in the access line's detail.
        assert not CLASS_NAME.search(failure.message), failure.message
        assert failure.detail().startswith(failure.message)


def test_stages_decide_retries_and_the_stream_code() -> None:
    timeout = UpstreamTimeout("worker timed out", answered=True)
    # A stream's head came but not its first event: nothing reached the client, so retry.
    assert failure_of(timeout, Stage.FIRST_EVENT, TIMEOUTS).retry is RetryReason.READ_TIMEOUT
    streamed = failure_of(timeout, Stage.STREAM, TIMEOUTS)
    assert (streamed.status, streamed.code, streamed.retry) == (502, "upstream_stream_error", None)
    lost = failure_of(
        UpstreamError("worker closed the connection", answered=True), Stage.FIRST_EVENT, TIMEOUTS
    )
    assert lost.retry is RetryReason.CONNECTION_LOST and lost.outcome is Outcome.WORKER_FAILED
    bad = failure_of(MalformedStream("an oversized SSE event"), Stage.FIRST_EVENT, TIMEOUTS)
    assert (bad.status, bad.retry, bad.outcome) == (502, RetryReason.MALFORMED_ANSWER, Outcome.WORKER_FAILED)
    assert failure_of(MalformedStream("x"), Stage.STREAM, TIMEOUTS).retry is None
    # The gateway's own connection cap: retried elsewhere, never held against the worker.
    busy = failure_of(UpstreamBusy("all 2 connections to the worker stayed busy"), Stage.HEAD, TIMEOUTS)
    assert (busy.status, busy.outcome, busy.retry) == (503, Outcome.ABORTED, RetryReason.WORKER_BUSY)
    assert busy.error().headers == {"retry-after": "1"}


def test_a_request_goes_to_another_worker_after_one_read_timeout_at_most() -> None:
    timed_out = failure_of(UpstreamTimeout("worker timed out", answered=False), Stage.HEAD, TIMEOUTS)
    busy = failure_of(UpstreamBusy("all 2 connections to the worker stayed busy"), Stage.HEAD, TIMEOUTS)
    seen = ReadTimeouts()
    for other in (busy, worker_status(500), busy):  # other failures use none of it
        seen.note(other)
    assert not seen.spent
    seen.note(timed_out)
    assert not seen.spent  # the first read timeout is retried ...
    seen.note(timed_out)
    assert seen.spent  # ... the second is not


def test_a_stream_that_breaks_says_so_in_plain_words() -> None:
    """A worker that dies mid-stream: the client reads what happened, not "worker stream failed:
    UpstreamError"; the log's detail keeps another library's class name."""
    closed = failure_of(UpstreamError("worker closed the connection", answered=True), Stage.STREAM, TIMEOUTS)
    assert closed.message == "worker stream failed mid-answer (worker closed the connection)"
    assert closed.detail() == closed.message
    stalled = failure_of(UpstreamTimeout("worker timed out", answered=True), Stage.STREAM, TIMEOUTS)
    assert stalled.message == "worker stream failed mid-answer (worker timed out)"
    payload = failure_of(
        aiohttp.ClientPayloadError("Response payload is not completed"), Stage.STREAM, TIMEOUTS
    )
    assert payload.message == "worker stream failed mid-answer (connection lost)"
    assert payload.detail() == "worker stream failed mid-answer (connection lost); ClientPayloadError"
    assert failure_of(TimeoutError(), Stage.STREAM, TIMEOUTS).message.endswith("(timed out)")


@pytest.mark.parametrize(
    ("out", "problem"),
    [
        (b'data: {"choices": []}\n\n', None),
        (b"data: [DONE]\n\n", None),
        (b': ping\n\ndata: {"choices": []}\n\n', None),
        (b'event: chunk\ndata: {"choices": []}\n\n', None),
        (b"data: <html>bad gateway</html>\n\n", "its first event is not JSON"),
        (b"<html>bad gateway</html>\n\n", "its first event carries no data"),
        (b"data: [1, 2]\n\n", "its first event is not a JSON object"),
    ],
)
def test_first_event_problem(out: bytes, problem: str | None) -> None:
    assert first_event_problem(out) == problem
