"""The lingering close against a real gateway process, over real sockets (`gateway/http_linger.py`):
answers written before the gateway ends a connection whose client is still sending reach that
client whole, with no reset, and the connection is released within its bounds.

Each client reads only once the gateway has ended its side of the connection (half-closed it, or
reset it): /proc/net/tcp shows the server's socket leave ESTABLISHED. Closed outright, these
connections were reset and the client lost answers or met the reset while sending.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from gateway.http_limits import MAX_PIPELINED
from gateway.http_linger import LINGER_S
from loadtest.abuse.probes_connections import parse_answers
from tests.support.processes import LoneGateway as Gateway
from tests.support.processes import lone_gateway
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

MAX_BODY_BYTES = 64 * 1024
MAX_HEADER_BYTES = 4096
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: k\r\n\r\n"
BURST_BYTES = 256 * 1024  # more than one read of the gateway's: most of it is left unread
ESTABLISHED = "01"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with lone_gateway(
        tmp_path_factory.mktemp("linger"),
        {"max_body_bytes": MAX_BODY_BYTES, "max_header_bytes": MAX_HEADER_BYTES},
    ) as gw:
        yield gw


def _server_side(gateway: Gateway, client_port: int) -> tuple[str, str] | None:
    """The gateway's socket of the connection from `client_port` in /proc/net/tcp: its state and
    inode (0 once the process has closed it and only the kernel holds it); None once it is gone."""
    local = f"0100007F:{gateway.port:04X}"  # 127.0.0.1, as /proc/net/tcp prints it
    remote = f"0100007F:{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return fields[3], fields[9]
    return None


def _ended(gateway: Gateway, client: socket.socket) -> bool:
    """The gateway has ended its side: half-closed (a lingering close) or closed (a reset)."""
    side = _server_side(gateway, client.getsockname()[1])
    return side is None or side[0] != ESTABLISHED


def _released(gateway: Gateway, client_port: int) -> bool:
    """The gateway process holds the socket of the connection from `client_port` no more."""
    side = _server_side(gateway, client_port)
    return side is None or side[1] == "0"


def _connect(gateway: Gateway, *, rcvbuf: int = 0, sndbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    # Set before connecting, so that the receive window is small from the start.
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", gateway.port))
    return sock


def _send_all(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise AssertionError(f"the gateway reset the connection while the client sent: {exc!r}") from None


def _read_to_end(sock: socket.socket) -> bytes:
    """Everything the connection still delivers, up to the gateway's FIN; a reset fails the test."""
    data = bytearray()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        raise AssertionError(f"reset after {len(data)} bytes: {bytes(data[:200])!r}") from None
    return bytes(data)


def _error_code(answer: bytes) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head
    return str(orjson.loads(body)["error"]["code"])


def test_a_burst_past_the_pipelining_bound_gets_every_answer_it_took(gateway: Gateway) -> None:
    # A receive window of about a kilobyte: most of the 17 answers wait in the gateway's socket.
    with _connect(gateway, rcvbuf=1024) as sock:
        _send_all(sock, HEALTHZ * (BURST_BYTES // len(HEALTHZ)))
        wait_until_sync(lambda: _ended(gateway, sock), what="the gateway ended its side")
        answers = parse_answers(_read_to_end(sock))
    assert answers.statuses == (200,) * (1 + MAX_PIPELINED)
    assert answers.last_closes and answers.trailing_bytes == 0


def test_a_body_too_large_sent_whole_by_a_client_asking_to_close_gets_its_413(gateway: Gateway) -> None:
    body = b"x" * (16 * MAX_BODY_BYTES)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: k\r\nAuthorization: Bearer sk-a\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    # A small send buffer: little of the body can hide in the kernel before the gateway reads it.
    with _connect(gateway, sndbuf=16 * 1024) as sock:
        _send_all(sock, head.encode() + body)  # answered from the head, before the body is read
        answer = _read_to_end(sock)
    assert answer.startswith(b"HTTP/1.1 413 ") and _error_code(answer) == "body_too_large"


def test_a_head_too_large_still_being_sent_gets_its_431(gateway: Gateway) -> None:
    head = b"GET /healthz HTTP/1.1\r\nX-Fill: " + b"a" * (256 * MAX_HEADER_BYTES) + b"\r\n\r\n"
    with _connect(gateway, sndbuf=16 * 1024) as sock:
        _send_all(sock, head)
        answer = _read_to_end(sock)
    assert answer.startswith(b"HTTP/1.1 431 ") and _error_code(answer) == "header_too_large"


def test_a_lingering_connection_is_released_when_its_client_closes_or_at_the_bound(
    gateway: Gateway,
) -> None:
    refused = b"GET /healthz HTTP/1.1\r\nX-Fill: " + b"a" * (2 * MAX_HEADER_BYTES)
    with _connect(gateway) as quiet, _connect(gateway) as leaving:
        for sock in (quiet, leaving):
            _send_all(sock, refused)  # then nothing more, and the socket kept open
            answer = _read_to_end(sock)  # the 431, then the gateway's FIN
            assert answer.startswith(b"HTTP/1.1 431 ")
        quiet_port, leaving_port = quiet.getsockname()[1], leaving.getsockname()[1]
        leaving.close()
        # Long before the bound: the gateway closes as soon as it reads the client's FIN.
        wait_until_sync(lambda: _released(gateway, leaving_port), LINGER_S / 2, "released on the FIN")
        assert not _released(gateway, quiet_port)
        wait_until_sync(lambda: _released(gateway, quiet_port), LINGER_S + 5, "released at the bound")
