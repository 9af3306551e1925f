"""The client limits of `GuardedHttpToolsProtocol` on a request's head and body and on idle time,
driven byte by byte (`http_limits_rig`): what is refused, what is answered, and when a connection
ends (a refusal's with a lingering close: `test_http_linger`)."""

from __future__ import annotations

import logging

import pytest

from gateway.config import LimitsConfig
from gateway.http_guard import ClientLimits
from gateway.http_limits import BODY, HEAD, IDLE
from tests.gateway.http_limits_rig import GET, LIMITS, Rig, post_head, rig, settle

__all__ = ["rig"]  # the fixture


async def test_a_request_within_the_limits_is_served_and_the_connection_then_idles(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(GET)
    await settle()
    assert transport.status() == 200 and not transport.closed
    assert protocol._phase == IDLE and protocol in rig.guard.waiting
    assert protocol.timeout_keep_alive_task is None  # no timer per request: the guard's tick instead


async def test_a_head_past_the_byte_limit_is_431_and_ends(rig: Rig) -> None:
    protocol, transport = rig.connect()
    protocol.data_received(b"GET /x HTTP/1.1\r\nX-Fill: ")
    protocol.data_received(b"a" * 600)
    assert not transport.ended  # 626 bytes so far
    protocol.data_received(b"a" * 600)
    assert transport.status() == 431 and transport.ended
    assert transport.json_body()["error"]["code"] == "header_too_large"
    assert rig.refusals("header_too_large") == 1
    await settle()
    assert protocol not in rig.guard.waiting


async def test_too_many_header_fields_is_431(rig: Rig) -> None:
    protocol, transport = rig.connect()
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(LIMITS.max_headers + 1))
    protocol.data_received(b"GET /x HTTP/1.1\r\n" + fields + b"\r\n")
    assert transport.status() == 431 and transport.ended
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
    assert slow_t.ended and slow_t.status() == 408
    assert slow_t.json_body()["error"]["code"] == "header_timeout"
    assert not body_t.ended  # its body deadline is later
    rig.guard.tick(body.deadline_s + 1.0)
    assert body_t.ended and body_t.status() == 408
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
    assert transport.ended and rig.refusals("header_too_large") == 1


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
            assert transport.status() == 431 and transport.ended
            assert transport.json_body()["error"]["code"] == "header_too_large"


async def test_a_head_at_the_limit_and_its_body_in_one_read_are_served(rig: Rig) -> None:
    protocol, transport = rig.connect()
    head = head_of(LIMITS.max_header_bytes, b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 3000\r\n")
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
    assert transport.ended and rig.refusals("header_too_large") == 1
    # Begun in one read, finished in the next with a body behind it.
    protocol, transport = rig.connect()
    head = head_of(LIMITS.max_header_bytes + 1, b"POST /x HTTP/1.1\r\nContent-Length:4000\r\n", b"X-Fill:")
    protocol.data_received(post_head(10) + b"x" * 10 + head[:10])
    protocol.data_received(head[10:] + b"x" * 4000)
    await settle()
    assert transport.ended and rig.refusals("header_too_large") == 2


async def test_a_request_asking_to_upgrade_with_a_body_is_refused_and_one_without_is_served(rig: Rig) -> None:
    # llhttp stops at the head of an upgrade request: its body never reached the app, which
    # answered for an empty body (curl --http2 on an http URL sends `Upgrade: h2c` with its POST).
    protocol, transport = rig.connect()
    upgrade = (
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
    )
    protocol.data_received(b"POST /x HTTP/1.1\r\nHost: h\r\n" + upgrade + b"Content-Length: 2\r\n\r\n{}")
    assert transport.status() == 400 and transport.ended
    assert transport.json_body()["error"]["code"] == "upgrade_with_body"
    assert rig.refusals("upgrade_with_body") == 1
    await settle()
    assert rig.app.disconnected == []  # the app never saw the request
    protocol, transport = rig.connect()
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: h\r\n" + upgrade + b"\r\n")
    await settle()
    assert transport.status() == 200


async def test_upgrade_requests_write_no_log_line(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # uvicorn's warning for an unsupported upgrade is two unstructured lines a request, which a
    # client without a key could write without bound.
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):  # the rig's connection limit
            protocol, transport = rig.connect()
            protocol.data_received(
                b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                b"HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n"
            )
            await settle()
            assert transport.status() == 200
    assert not [r for r in caplog.records if "upgrade" in r.getMessage().lower()]
