"""One failure map for both upstream transports: the lean client and aiohttp, driven against the
same scripted workers, fail the same way in the gateway's terms."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from gateway.config.pool import TimeoutsConfig
from gateway.failure import TRANSPORT_ERRORS, Failure, RetryReason, Stage, failure_of
from gateway.sse import MalformedStream, first_event_problem
from gateway.upstream import UpstreamBusy, UpstreamError, UpstreamPool, UpstreamTimeout
from policies.base import Outcome
from tests.gateway.fake_upstream import Handler, Server, post, read_request
from tests.support.processes import free_port

TIMEOUTS = TimeoutsConfig(connect_s=1.0, read_s=0.2, total_s=10.0)
# A Python class name in a client's message ("ConnectionRefusedError", "UpstreamError").
CLASS_NAME = re.compile(r"[A-Z][A-Za-z]*(Error|Exception)\b")


async def _lean(port: int) -> Failure:
    pool = UpstreamPool()
    try:
        await pool.post("127.0.0.1", port, post(), connect_s=1.0, read_s=0.2, total_s=10.0)
    except TRANSPORT_ERRORS as exc:
        return failure_of(exc, Stage.HEAD, TIMEOUTS)
    finally:
        pool.close()
    raise AssertionError("the request did not fail")


async def _aiohttp(port: int) -> Failure:
    """As the proxy drives aiohttp: the head first (Stage.HEAD), then the body (Stage.ANSWER)."""
    timeout = aiohttp.ClientTimeout(total=10.0, sock_connect=1.0, sock_read=0.2)
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


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    await read_request(reader)
    await asyncio.sleep(2)


async def _hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    await read_request(reader)  # ... and the fixture closes the connection


async def _dies_mid_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
    await writer.drain()


async def _stalls_mid_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
    await writer.drain()
    await asyncio.sleep(2)


# scripted worker: status, code, outcome, retry reason, message prefix (both transports)
CASES: dict[str, tuple[Handler | None, int, str, Outcome, RetryReason | None, str]] = {
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
    port = (await serve(handler)).port if handler is not None else free_port()
    for failure in (await _lean(port), await _aiohttp(port)):
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
