"""The client limits of `GuardedHttpToolsProtocol`, driven byte by byte through a recording
transport (no sockets): what is refused, what is answered, and when a connection is closed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.config import LimitsConfig
from gateway.http_limits import (
    BODY,
    HEAD,
    IDLE,
    MAX_PIPELINED,
    ClientGuard,
    ClientLimits,
    GuardedHttpToolsProtocol,
    GuardedServerState,
)
from gateway.metrics import GatewayMetrics

LIMITS = ClientLimits(
    max_header_bytes=1024,
    max_headers=8,
    header_timeout_s=10.0,
    body_timeout_s=20.0,
    keepalive_timeout_s=30.0,
    max_connections=3,
)


class RecordingTransport(asyncio.Transport):
    """Keeps what the protocol writes; closing reports the loss to the protocol, as asyncio does."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def status(self) -> int | None:
        line = bytes(self.written).split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) > 1 else None

    def json_body(self) -> Any:
        return orjson.loads(bytes(self.written).split(b"\r\n\r\n", 1)[1])


@dataclass
class App:
    """Reads the whole body, then answers 200; notes whether it saw the client leave."""

    disconnected: list[bool] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.append(True)
                return
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@dataclass
class Rig:
    app: App
    guard: ClientGuard
    state: GuardedServerState
    config: uvicorn.Config
    metrics: GatewayMetrics

    def connect(self) -> tuple[GuardedHttpToolsProtocol, RecordingTransport]:
        protocol = GuardedHttpToolsProtocol(self.config, self.state, {})
        transport = RecordingTransport(protocol)
        protocol.connection_made(transport)
        return protocol, transport

    def refusals(self, reason: str) -> float:
        return self.metrics.client_refusals.labels(reason).value


@pytest.fixture
def rig() -> Iterator[Rig]:
    app = App()
    metrics = GatewayMetrics()
    guard = ClientGuard(LIMITS, metrics.client_refusals)
    config = uvicorn.Config(
        app, http=GuardedHttpToolsProtocol, ws="none", lifespan="off", log_level="warning"
    )
    config.load()
    yield Rig(app, guard, GuardedServerState(guard), config, metrics)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


GET = b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n"


def post_head(length: int) -> bytes:
    return f"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: {length}\r\n\r\n".encode()


async def test_a_request_within_the_limits_is_served_and_the_connection_then_idles(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(GET)
    await settle()
    assert transport.status() == 200 and not transport.closed
    assert protocol._phase == IDLE and protocol in rig.guard.waiting
    assert protocol.timeout_keep_alive_task is None  # no timer per request: the guard's tick instead


async def test_a_head_past_the_byte_limit_is_431_and_closed(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(b"GET /x HTTP/1.1\r\nX-Fill: ")
    protocol.data_received(b"a" * 600)
    assert not transport.closed  # 626 bytes so far
    protocol.data_received(b"a" * 600)
    assert transport.status() == 431 and transport.closed
    assert transport.json_body()["error"]["code"] == "header_too_large"
    assert rig.refusals("header_too_large") == 1
    await settle()
    assert protocol not in rig.guard.waiting and protocol not in rig.state.connections


async def test_too_many_header_fields_is_431(rig: Rig) -> None:
    protocol, transport = rig.connect()
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(LIMITS.max_headers + 1))
    protocol.data_received(b"GET /x HTTP/1.1\r\n" + fields + b"\r\n")
    assert transport.status() == 431 and transport.closed
    assert transport.json_body()["error"]["code"] == "too_many_headers"
    await settle()
    assert rig.app.disconnected == []  # the app never saw the request


async def test_body_bytes_never_count_toward_the_head(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(post_head(3000) + b"x" * 1500)
    protocol.data_received(b"x" * 1500)
    await settle()
    assert transport.status() == 200
    # A pipelined next request whose head starts inside a large chunk is not charged for the
    # previous body's bytes.
    transport.written.clear()
    protocol.data_received(post_head(2000) + b"x" * 2000 + b"GET /y HTTP/1.1\r\n")
    protocol.data_received(b"Host: h\r\n\r\n")
    await settle()
    assert transport.written.count(b"HTTP/1.1 200") == 2 and not transport.closed


async def test_connections_beyond_the_process_limit_are_closed_at_once(rig: Rig) -> None:
    held = [rig.connect() for _ in range(LIMITS.max_connections)]
    protocol, transport = rig.connect()
    assert transport.closed and transport.written == b""
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
    assert not rig.connect()[1].closed  # a free place is taken again


async def test_connections_beyond_the_limit_per_client_address_are_closed_at_once(rig: Rig) -> None:
    limits = dataclasses.replace(LIMITS, max_connections=10, max_connections_per_address=2)
    guard = ClientGuard(limits, rig.metrics.client_refusals)
    rig = dataclasses.replace(rig, guard=guard, state=GuardedServerState(guard))
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


async def test_deadlines_close_each_phase_its_own_way(rig: Rig) -> None:
    silent, silent_t = rig.connect()  # sends nothing
    slow, slow_t = rig.connect()
    slow.data_received(b"GET /x HT")
    body, body_t = rig.connect()
    body.data_received(post_head(10) + b"12345")
    await settle()
    assert body._phase == BODY
    rig.guard.tick(silent.deadline_s + LIMITS.header_timeout_s)
    assert silent_t.closed and silent_t.written == b""
    assert slow_t.closed and slow_t.status() == 408
    assert slow_t.json_body()["error"]["code"] == "header_timeout"
    assert not body_t.closed  # its body deadline is later
    rig.guard.tick(body.deadline_s + 1.0)
    assert body_t.closed and body_t.status() == 408
    await settle()
    assert rig.app.disconnected == [True]  # the app waiting for the body saw the client leave
    assert not rig.guard.waiting
    assert rig.refusals("header_timeout") == 1 and rig.refusals("body_timeout") == 1


async def test_an_idle_connection_is_closed_at_its_keepalive_deadline(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(GET)
    await settle()
    rig.guard.tick(protocol.deadline_s - 1.0)
    assert not transport.closed
    rig.guard.tick(protocol.deadline_s + 1.0)
    assert transport.closed and transport.written.count(b"HTTP/1.1") == 1  # nothing more sent


async def test_new_bytes_on_an_idle_connection_start_the_header_clock(rig: Rig) -> None:
    protocol, _ = rig.connect()
    protocol.data_received(GET)
    await settle()
    idle_deadline = protocol.deadline_s
    protocol.data_received(b"\r\n")  # not even a request start: still bounded by the header deadline
    assert protocol._phase == HEAD and protocol.deadline_s < idle_deadline


def test_the_check_interval_follows_the_shortest_timeout() -> None:
    assert ClientLimits.of(LimitsConfig()).check_interval_s == 1.0
    short = ClientLimits.of(LimitsConfig(header_timeout_s=0.5))
    assert short.check_interval_s == 0.1


def test_the_guard_checks_at_most_once_per_interval(rig: Rig) -> None:
    class Expiring:
        deadline_s = 0.0
        expired = 0

        def expire(self) -> None:
            self.expired += 1

    conn = Expiring()
    rig.guard.waiting.add(conn)  # type: ignore[arg-type]
    rig.guard.tick(5.0)
    rig.guard.tick(5.5)
    assert conn.expired == 1
    rig.guard.tick(6.0)
    assert conn.expired == 2


async def test_a_pipelined_head_is_still_bounded_from_its_next_chunk(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(post_head(10) + b"x" * 10 + b"GET /y HTTP/1.1\r\nX-Fill: ")
    protocol.data_received(b"a" * (LIMITS.max_header_bytes + 1))
    await settle()
    assert transport.closed and rig.refusals("header_too_large") == 1


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
    assert transport.closed


async def test_pipelined_requests_up_to_the_limit_are_all_answered_on_an_open_connection(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(GET * (1 + MAX_PIPELINED))
    await answered(transport, 1 + MAX_PIPELINED)
    protocol.data_received(GET)  # and the connection reads on
    await answered(transport, 2 + MAX_PIPELINED)
    await settle()
    assert not transport.closed and b"connection: close" not in transport.written
    assert rig.refusals("pipelined_requests") == 0


def head_of(size: int, start: bytes = b"GET /x HTTP/1.1\r\nHost: h\r\n", fill: bytes = b"X-Fill: ") -> bytes:
    """A request head of exactly `size` bytes, padded with one header field."""
    start += fill
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


@pytest.mark.parametrize("split", [None, 20, 1020, 1021, 1022, 1023])
async def test_a_finished_head_is_measured_to_its_blank_line_however_it_is_split(
    rig: Rig, split: int | None
) -> None:
    limit = LIMITS.max_header_bytes
    for size, served in ((limit, True), (limit + 1, False)):
        protocol, transport = rig.connect()
        head = head_of(size)
        at = len(head) if split is None else min(split, len(head))
        protocol.data_received(head[:at])
        if at < len(head):
            protocol.data_received(head[at:])
        await settle()
        if served:
            assert transport.status() == 200 and not transport.closed
        else:
            assert transport.status() == 431 and transport.closed
            assert transport.json_body()["error"]["code"] == "header_too_large"


async def test_a_head_at_the_limit_and_its_body_in_one_read_are_served(rig: Rig) -> None:
    protocol, transport = rig.connect()
    head = head_of(LIMITS.max_header_bytes, b"POST /x HTTP/1.1\r\nContent-Length: 3000\r\n")
    protocol.data_received(head + b"x" * 3000)
    await settle()
    assert transport.status() == 200 and not transport.closed


async def test_blank_lines_before_a_request_count_toward_its_head(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(b"\r\n" * 400 + head_of(LIMITS.max_header_bytes - 799) + b"\r\n\r\n")
    await settle()
    assert transport.status() == 431  # the blank lines cannot hide the head's end


async def test_a_head_pipelined_behind_a_body_is_measured_from_its_parts(rig: Rig) -> None:
    # Without optional whitespace, so that the lower bound from the parsed parts is exact.
    def bare_head(size: int) -> bytes:
        return head_of(size, b"GET /x HTTP/1.1\r\nHost:h\r\n", b"X-Fill:")

    protocol, transport = rig.connect()
    protocol.data_received(post_head(10) + b"x" * 10 + bare_head(LIMITS.max_header_bytes))
    await settle()
    assert transport.written.count(b"HTTP/1.1 200") == 2 and not transport.closed
    protocol, transport = rig.connect()
    protocol.data_received(post_head(10) + b"x" * 10 + bare_head(LIMITS.max_header_bytes + 1))
    await settle()
    assert transport.closed and rig.refusals("header_too_large") == 1
    # Begun in one read, finished in the next with a body behind it.
    protocol, transport = rig.connect()
    head = head_of(LIMITS.max_header_bytes + 1, b"POST /x HTTP/1.1\r\nContent-Length:4000\r\n", b"X-Fill:")
    protocol.data_received(post_head(10) + b"x" * 10 + head[:10])
    protocol.data_received(head[10:] + b"x" * 4000)
    await settle()
    assert transport.closed and rig.refusals("header_too_large") == 2


class AbortableTransport(RecordingTransport):
    """A recording transport that can be aborted, as a socket transport is: the loss is reported
    to the protocol with nothing more written."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        super().__init__(protocol)
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        self.close()


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


def slow_reader_rig(rig: Rig) -> tuple[SlowReaderApp, GuardedHttpToolsProtocol, AbortableTransport]:
    app = SlowReaderApp()
    config = uvicorn.Config(
        app, http=GuardedHttpToolsProtocol, ws="none", lifespan="off", log_level="warning"
    )
    config.load()
    protocol = GuardedHttpToolsProtocol(config, rig.state, {})
    transport = AbortableTransport(protocol)
    protocol.connection_made(transport)
    return app, protocol, transport


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
    assert rig.guard.stalled == {protocol}
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
