"""The lingering close of `GuardedHttpToolsProtocol` (`gateway/http_linger.py`), driven byte by byte
(`http_limits_rig`): which endings linger, what a lingering connection does with the bytes it
still reads, and the bounds that close it. `test_http_linger_process` runs the same endings
against a real gateway process over real sockets."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway import http_linger
from gateway.http_guard import ClientGuard, GuardedServerState
from gateway.http_limits import MAX_PIPELINED, GuardedHttpToolsProtocol
from tests.gateway.http_limits_rig import GET, LIMITS, RecordingTransport, Rig, post_head, rig, settle
from tests.support.wait import wait_until

__all__ = ["rig"]  # the fixture

TOO_LARGE_HEAD = b"GET /x HTTP/1.1\r\nX-Fill: " + b"a" * (LIMITS.max_header_bytes + 1)


def answers(transport: RecordingTransport) -> list[bytes]:
    return bytes(transport.written).split(b"HTTP/1.1 ")[1:]


async def test_a_refusal_is_answered_then_half_closed_and_what_follows_is_dropped(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_linger, "LINGER_S", 0.2)
    protocol, transport = rig.connect()
    protocol.data_received(TOO_LARGE_HEAD)
    assert transport.status() == 431 and transport.eof and not transport.closed
    assert transport.reading  # it reads on, to drop what the client still sends
    protocol.data_received(GET * 20)
    await settle()
    assert len(answers(transport)) == 1  # nothing more parsed, nothing more answered
    assert protocol not in rig.guard.waiting and protocol in rig.state.connections
    await wait_until(lambda: transport.closed, what="closed at the end of the linger")
    await settle()
    assert protocol not in rig.state.connections


async def test_a_lingering_connection_holds_its_place_under_the_connection_limits(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_linger, "LINGER_S", 0.2)
    limits = dataclasses.replace(LIMITS, max_connections=2, max_connections_per_address=1)
    guard = ClientGuard(limits, rig.metrics.client_refusals)
    rig = dataclasses.replace(rig, guard=guard, state=GuardedServerState(guard))
    protocol, transport = rig.connect()
    protocol.data_received(TOO_LARGE_HEAD)
    assert transport.eof and guard.by_address == {"127.0.0.1": 1}
    _, refused = rig.connect()  # the same address, past its limit of one
    assert refused.closed and refused.written == b"" and rig.refusals("address_limit") == 1
    await wait_until(lambda: transport.closed, what="closed at the end of the linger")
    await settle()
    assert guard.by_address == {}
    assert not rig.connect()[1].closed  # its place is free again


async def test_past_the_linger_bytes_the_connection_is_closed_at_once(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_linger, "LINGER_BYTES", 1000)
    protocol, transport = rig.connect()
    protocol.data_received(TOO_LARGE_HEAD)
    protocol.data_received(b"x" * 600)
    assert not transport.closed
    protocol.data_received(b"x" * 600)
    assert transport.closed


async def test_bytes_past_the_bound_while_answers_are_owed_stop_the_reads(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_linger, "LINGER_BYTES", 1000)
    protocol, transport = rig.connect()
    protocol.data_received(GET * 1000)  # past the pipelining bound
    assert not transport.reading
    protocol.flow.resume_reading()  # as an app's `receive` does
    assert transport.reading
    protocol.data_received(b"x" * 1001)
    assert not transport.reading
    await wait_until(lambda: transport.closed, what="closed once the answers are written")
    assert len(answers(transport)) == 1 + MAX_PIPELINED  # written whole; no linger past the bound
    assert not transport.eof


@dataclass
class AnswersFirst:
    """Answers 413 without reading the body, as the gateway does from a too large Content-Length."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


@dataclass
class Held:
    """Reads the whole body and answers 200 once `go` is set (the first request only: later ones
    at once); notes each request's path and whether it saw its client leave."""

    go: asyncio.Event = field(default_factory=asyncio.Event)
    paths: list[str] = field(default_factory=list)
    disconnected: list[bool] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.paths.append(scope["path"])
        while (message := await receive())["type"] == "http.request" and message.get("more_body"):
            pass
        if message["type"] == "http.disconnect":
            self.disconnected.append(True)
            return
        if len(self.paths) == 1:
            await self.go.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def serving(rig: Rig, app: object) -> tuple[GuardedHttpToolsProtocol, RecordingTransport]:
    config = uvicorn.Config(
        app, http=GuardedHttpToolsProtocol, ws="none", lifespan="off", log_level="warning"
    )
    config.load()
    protocol = GuardedHttpToolsProtocol(config, rig.state, {})
    transport = RecordingTransport(protocol)
    protocol.connection_made(transport)
    return protocol, transport


async def test_a_client_asking_to_close_lingers_only_when_its_body_was_left_unread(rig: Rig) -> None:
    close = b"POST /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\nContent-Length: 1000\r\n\r\n"
    protocol, transport = serving(rig, AnswersFirst())
    protocol.data_received(close + b"x" * 10)  # answered from its head; 990 bytes still to come
    await settle()
    assert transport.status() == 413 and b"connection: close" in transport.written
    assert transport.eof and not transport.closed
    protocol.data_received(b"x" * 990)
    assert len(answers(transport)) == 1
    # Read whole before its answer: closed as before.
    protocol, transport = rig.connect()
    protocol.data_received(close + b"x" * 1000)
    await settle()
    assert transport.status() == 200 and transport.closed and not transport.eof


async def test_a_refused_head_behind_an_answer_under_way_ends_it_unanswered(rig: Rig) -> None:
    app = Held()
    protocol, transport = serving(rig, app)
    protocol.data_received(GET + TOO_LARGE_HEAD + b"\r\n\r\n")  # measured when complete
    assert rig.refusals("header_too_large") == 1
    assert transport.eof and transport.written == b""  # no 431 in front of the answer not out yet
    app.go.set()
    await settle()
    assert transport.written == b""  # the request saw its client leave: its answer is dropped
    assert not transport.closed


async def test_a_body_refused_while_queued_behind_an_answer_is_dropped_unanswered(rig: Rig) -> None:
    app = Held()
    protocol, transport = serving(rig, app)
    first = post_head(2) + b"ok"
    protocol.data_received(first + b"POST /late HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n12345")
    await settle()
    assert len(protocol.pipeline) == 1  # the second waits, its body unfinished
    rig.guard.tick(protocol.deadline_s + 1.0)
    assert rig.refusals("body_timeout") == 1
    assert transport.written == b""  # no 408 in the middle of the answer under way
    app.go.set()
    await wait_until(lambda: transport.eof, what="half-closed after the answer")
    (answer,) = answers(transport)
    assert answer.startswith(b"200") and app.paths == ["/x"]  # the refused request never ran


async def test_a_request_expecting_100_continue_gets_no_interim_answer_once_the_linger_began(
    rig: Rig,
) -> None:
    """Its app reads its body after the refusal behind it began the linger: uvicorn's `receive`
    would first write `100 Continue`, after the FIN (the rig's transport, like uvloop's, refuses
    a write after `write_eof`)."""
    protocol, transport = rig.connect()
    expect = b"POST /x HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n"
    protocol.data_received(expect + TOO_LARGE_HEAD + b"\r\n\r\n")  # measured when complete
    assert transport.eof and rig.refusals("header_too_large") == 1
    await settle()
    assert rig.app.disconnected == [True]  # its receive says the client left, and writes nothing
    assert b"100 Continue" not in transport.written


async def test_a_linger_ending_with_answers_unread_is_aborted_at_the_send_timeout(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close at the linger's end waits for the buffered answers, which a client that reads
    nothing never takes; below the high-water mark its writes never paused."""
    monkeypatch.setattr(http_linger, "LINGER_S", 0.05)
    protocol, transport = rig.connect()
    transport.buffered = 1000  # the refusal's answer, not read
    protocol.data_received(TOO_LARGE_HEAD)
    await wait_until(lambda: transport.closed, what="closed at the end of the linger")
    await settle()
    assert protocol in rig.state.connections and set(rig.guard.stalled) == {protocol}
    rig.guard.tick(protocol.send_deadline_s - 1.0)
    assert not transport.aborted
    rig.guard.tick(protocol.send_deadline_s + 1.0)
    assert transport.aborted and rig.refusals("send_timeout") == 1
    await settle()
    assert protocol not in rig.state.connections and not rig.guard.stalled


@pytest.mark.parametrize("reads", [False, True])
async def test_a_close_after_an_answer_waits_for_a_client_that_reads_it(rig: Rig, reads: bool) -> None:
    """The same bound on uvicorn's close after an answer to a client that asked to close; a
    client that reads what was buffered is let go without an abort."""
    protocol, transport = rig.connect()
    transport.buffered = 1000
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    await wait_until(lambda: transport.closed, what="closed after its answer")
    assert transport.status() == 200 and set(rig.guard.stalled) == {protocol}
    if reads:
        transport.read_by_client()
    else:
        rig.guard.tick(protocol.send_deadline_s + 1.0)
    await settle()
    assert transport.aborted is not reads and protocol not in rig.state.connections
    assert not rig.guard.stalled and rig.refusals("send_timeout") == (0 if reads else 1)
