"""The client limits of `GuardedHttpToolsProtocol` on connections (`http_limits_rig`): how many
a process and one client address may hold, which connection a full table closes for a new one (in
each phase; over real sockets: `test_http_eviction`), how many pipelined requests wait on one, and
how long an answer may wait on a client that reads nothing."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from starlette.types import Receive, Scope, Send

from gateway.config import LimitsConfig
from gateway.http_guard import ClientLimits
from gateway.http_limits import MAX_PIPELINED, GuardedHttpToolsProtocol
from tests.gateway.http_limits_rig import GET, LIMITS, RecordingTransport, Rig, post_head, rig, settle

__all__ = ["rig"]  # the fixture

TOO_LARGE_HEAD = b"GET /x HTTP/1.1\r\nX-Fill: " + b"a" * (LIMITS.max_header_bytes + 1)


async def test_connections_beyond_the_process_limit_are_closed_at_once_when_each_has_a_request(
    rig: Rig,
) -> None:
    held = [rig.connect() for _ in range(LIMITS.max_connections)]
    for held_protocol, _ in held:
        held_protocol.data_received(post_head(10))  # the app waits on its body
    protocol, transport = rig.connect()
    assert transport.closed and transport.written == b""
    assert not any(held_transport.closed for _, held_transport in held)
    assert protocol not in rig.guard.waiting
    assert rig.refusals("connection_limit") == 1
    await settle()
    metrics = GuardedHttpToolsProtocol(rig.config, rig.state, {}, capped=False)
    metrics_transport = RecordingTransport(metrics)
    metrics.connection_made(metrics_transport)
    assert not metrics_transport.closed  # monitoring is never locked out
    held[0][1].close()
    metrics_transport.close()
    await settle()
    _, taken = rig.connect()
    assert not taken.closed  # a free place is taken again
    for _, open_transport in [*held[1:], (None, taken)]:
        open_transport.close()
    await settle()
    assert not rig.state.connections and rig.app.disconnected == [True] * len(held)


async def test_connections_beyond_the_limit_per_client_address_are_closed_at_once(rig: Rig) -> None:
    rig = rig.with_limits(dataclasses.replace(LIMITS, max_connections=10, max_connections_per_address=2))
    guard = rig.guard
    held = [rig.connect() for _ in range(2)]
    _, transport = rig.connect()  # every connection of the rig is from 127.0.0.1
    assert transport.closed and transport.written == b""
    assert rig.refusals("address_limit") == 1
    assert guard.by_address == {"127.0.0.1": 2}
    held[0][1].close()
    await settle()
    assert guard.by_address == {"127.0.0.1": 1}
    assert not rig.connect()[1].closed  # a free place is taken again
    for _, held_transport in held[1:]:
        held_transport.close()
    await settle()
    assert guard.by_address == {"127.0.0.1": 1}  # the one just opened


async def answered(transport: RecordingTransport, count: int) -> None:
    """Wait until `count` answers have been written (each is a task's few loop turns)."""
    for _ in range(100 * count):
        if transport.written.count(b"HTTP/1.1 ") >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{transport.written.count(b'HTTP/1.1 ')} answers written, not {count}")


async def test_pipelined_requests_past_the_limit_are_not_read_and_the_taken_ones_are_answered(
    rig: Rig,
) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(GET * 1000)  # one read: about 28 KB, a thousand requests
    # One request is with the app and MAX_PIPELINED wait; the parser stopped at the next one.
    assert len(protocol.pipeline) == MAX_PIPELINED
    assert rig.refusals("pipelined_requests") == 1
    protocol.data_received(GET)  # nothing more is read
    await answered(transport, 1 + MAX_PIPELINED)
    await settle()
    answers = bytes(transport.written).split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 1 + MAX_PIPELINED and all(a.startswith(b"200") for a in answers)
    assert b"connection: close" in answers[-1] and b"connection: close" not in answers[-2]
    assert transport.eof and not transport.closed  # a lingering close (`test_http_linger`)


async def test_pipelined_requests_up_to_the_limit_are_all_answered_on_an_open_connection(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(GET * (1 + MAX_PIPELINED))
    await answered(transport, 1 + MAX_PIPELINED)
    protocol.data_received(GET)  # and the connection reads on
    await answered(transport, 2 + MAX_PIPELINED)
    await settle()
    assert not transport.closed and b"connection: close" not in transport.written
    assert rig.refusals("pipelined_requests") == 0


@dataclass
class SlowReaderApp:
    """Sends its answer's head, then (once `go` is set) its body, noting when the body's send
    returned and whether it then saw its client leave."""

    go: asyncio.Event = field(default_factory=asyncio.Event)
    body_sent: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: list[bool] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await self.go.wait()
        await send({"type": "http.response.body", "body": b"done"})
        self.body_sent.set()
        if (await receive())["type"] == "http.disconnect":
            self.disconnected.append(True)


def slow_reader_rig(rig: Rig) -> tuple[SlowReaderApp, GuardedHttpToolsProtocol, RecordingTransport]:
    app = SlowReaderApp()
    return app, *rig.serve(app)


async def test_a_connection_sending_its_next_head_keeps_its_place_until_the_answer_is_complete(
    rig: Rig,
) -> None:
    rig = rig.with_limits(dataclasses.replace(LIMITS, max_connections=1))
    app, protocol, transport = slow_reader_rig(rig)
    protocol.data_received(GET)
    protocol.data_received(b"GET /x HT")  # the next head, sent while the answer is under way
    await settle()
    _, refused = rig.connect("127.0.0.2")
    assert refused.closed and rig.refusals("connection_limit") == 1 and not transport.closed
    app.go.set()
    await settle()  # answered; the next head is still unfinished
    _, newcomer = rig.connect("127.0.0.2")
    assert not newcomer.closed and transport.closed and rig.refusals("evicted") == 1
    await settle()
    assert rig.state.connections == {newcomer.protocol} and app.disconnected == [True]
    rig.guard.evictable.check_invariants()


@dataclass
class HeadersOnlyApp:
    """Answers 401 from the headers, as a request without a valid key is: its body is not read."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


async def test_a_lingering_connection_and_one_sending_an_answered_body_give_their_places(rig: Rig) -> None:
    rig = rig.with_limits(dataclasses.replace(LIMITS, max_connections=2))
    lingering, lingering_transport = rig.connect()
    lingering.data_received(TOO_LARGE_HEAD)  # 431, then a lingering close
    assert lingering_transport.eof and not lingering_transport.closed
    answered, answered_transport = rig.serve(HeadersOnlyApp())
    answered.data_received(post_head(1000) + b"x" * 10)  # the rest of the body never comes
    await settle()
    assert answered_transport.status() == 401 and not answered_transport.ended
    _, newcomer = rig.connect("127.0.0.2")  # 127.0.0.1 holds both: its oldest goes
    assert not newcomer.closed and lingering_transport.closed and not answered_transport.closed
    await settle()
    _, next_one = rig.connect("127.0.0.3")  # one each: 127.0.0.1 has held one longest
    assert not next_one.closed and answered_transport.closed and not newcomer.closed
    assert rig.refusals("evicted") == 2 and rig.refusals("connection_limit") == 0
    await settle()
    assert rig.guard.evictable.held_by("127.0.0.1") == 0
    rig.guard.evictable.check_invariants()


async def test_an_answer_waiting_on_a_client_that_reads_nothing_is_aborted_at_the_send_timeout(
    rig: Rig,
) -> None:
    app, protocol, transport = slow_reader_rig(rig)
    protocol.data_received(GET)
    await settle()
    protocol.pause_writing()  # the client stopped reading: the transport's buffer is full
    app.go.set()
    await settle()
    assert not app.body_sent.is_set()  # the send waits for the buffer to drain
    assert set(rig.guard.stalled) == {protocol}
    rig.guard.tick(protocol.send_deadline_s - 1.0)
    assert not transport.closed
    rig.guard.tick(protocol.send_deadline_s + 1.0)
    assert transport.aborted
    await settle()
    assert app.body_sent.is_set() and app.disconnected == [True]  # the send returned; the client left
    assert b"done" not in transport.written
    assert not rig.guard.stalled and not rig.guard.waiting
    assert rig.refusals("send_timeout") == 1


async def test_a_client_that_reads_again_before_the_send_timeout_is_not_cut_off(rig: Rig) -> None:
    app, protocol, transport = slow_reader_rig(rig)
    protocol.data_received(GET)
    await settle()
    protocol.pause_writing()
    app.go.set()
    await settle()
    protocol.resume_writing()  # it read: the buffer drained below the low-water mark
    await settle()
    assert app.body_sent.is_set() and bytes(transport.written).endswith(b"done")
    assert not rig.guard.stalled
    rig.guard.tick(protocol.send_deadline_s + 1.0)  # (the idle connection's keep-alive ends it)
    assert not transport.aborted and rig.refusals("send_timeout") == 0


def test_the_send_timeout_counts_toward_the_check_interval() -> None:
    assert ClientLimits.of(LimitsConfig(send_timeout_s=0.5)).check_interval_s == 0.1
