"""The `Host` and `Transfer-Encoding` checks of a request head (`gateway/http_framing.py`) against a
real gateway process, over raw sockets: what is refused (400 or 501, with the error code, and the
connection ended), what is still served, and that nothing pipelined behind a refused head is.

The gateway has no worker that answers: a chat request whose JSON body the app read gets 503
`no_worker_available`, which tells a body that arrived as sent from one that did not (400).
"""

from __future__ import annotations

import gzip
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from loadtest.abuse.probes_connections import parse_answers
from tests.support.gateway_config import tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start_gateway

pytestmark = pytest.mark.e2e

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: k\r\n\r\n"
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@dataclass
class Gateway:
    port: int
    metrics_url: str
    proc: Proc


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder: Path = tmp_path_factory.mktemp("framing")
    (folder / "policy.yaml").write_text("policy: cost\n")
    config = write_gateway_config(
        folder / "gateway.yaml",
        [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{free_port()}"]}],
        [tenant("a", "sk-a")],
        policy_file="policy.yaml",
    )
    port, metrics_port = free_port(), free_port()
    proc = start_gateway(config, port, metrics_port)
    try:
        yield Gateway(port, f"http://127.0.0.1:{metrics_port}/metrics", proc)
    finally:
        proc.stop()


def _exchange(gateway: Gateway, *requests: bytes) -> bytes:
    """Send `requests` in one write and read everything up to the gateway's FIN (a reset fails)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(b"".join(requests))
        data = bytearray()
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            raise AssertionError(f"reset after {len(data)} bytes: {bytes(data[:200])!r}") from None
    return bytes(data)


def _read_answer(sock: socket.socket) -> bytes:
    """One answer (a head and its `content-length` body) off a connection that stays open."""
    data = b""
    while not parse_answers(data).statuses:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def _refusals(gateway: Gateway, reason: str) -> float:
    series = f'kvgate_client_refusals_total{{reason="{reason}"}} '
    for line in httpx.get(gateway.metrics_url, timeout=5).text.splitlines():
        if line.startswith(series):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _assert_refused(gateway: Gateway, status: int, code: str, *requests: bytes) -> None:
    """The first of `requests` gets `status` with error `code`, counted as a refusal, and the
    connection ends after it: nothing behind it is answered."""
    before = _refusals(gateway, code)
    answer = _exchange(gateway, *requests)
    assert parse_answers(answer).statuses == (status,), answer[:300]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head
    assert orjson.loads(body)["error"]["code"] == code
    assert _refusals(gateway, code) == before + 1  # counted before the answer was written


def _chat(transfer_encoding: bytes, body: bytes, version: bytes = b"1.1", host: bytes = b"k") -> bytes:
    """A chat request with its body in one chunk, framed as `transfer_encoding` says."""
    host_line = b"Host: " + host + b"\r\n" if host else b""
    return (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\n" + host_line
        + b"Authorization: Bearer sk-a\r\nContent-Type: application/json\r\n"
        + b"Transfer-Encoding: " + transfer_encoding + b"\r\nConnection: close\r\n\r\n"
        + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    )  # fmt: skip


def test_an_http_1_1_request_without_host_is_400_and_an_http_1_0_one_is_served(gateway: Gateway) -> None:
    _assert_refused(gateway, 400, "missing_host", b"GET /healthz HTTP/1.1\r\n\r\n")
    answer = _exchange(gateway, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert parse_answers(answer).statuses == (200,)


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_two_host_lines_are_400(gateway: Gateway, version: bytes) -> None:
    request = b"GET /healthz HTTP/" + version + b"\r\nHost: a\r\nHost: b\r\n\r\n"
    _assert_refused(gateway, 400, "duplicate_host", request)


@pytest.mark.parametrize("host", [b"", b"a b", b"a/b", b"user@a", b"a:80x", b"[::1", b"[::1]x", b"a%zz"])
def test_a_host_that_is_not_host_and_port_is_400(gateway: Gateway, host: bytes) -> None:
    _assert_refused(gateway, 400, "invalid_host", b"GET /healthz HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")


def test_each_request_of_a_connection_has_its_host_checked(gateway: Gateway) -> None:
    # One at a time: a head refused behind pipelined requests drops them unanswered.
    # Valid ones are served, a repeated one from what the connection remembers; the last one,
    # invalid, is refused although the one before it was valid.
    valid = [b"127.0.0.1:8080", b"127.0.0.1:8080", b"[::1]:8080", b"api.example.com", b"localhost:", b"a%2Db"]
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        for host in valid:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
            assert _read_answer(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a b\r\n\r\n")
        assert b'"code":"invalid_host"' in _read_answer(sock)


@pytest.mark.parametrize(
    "transfer_encoding",
    [b"gzip, chunked", b"GZIP,chunked", b"identity, chunked", b"gzip\r\nTransfer-Encoding: chunked"],
)
def test_a_transfer_coding_before_chunked_is_501(gateway: Gateway, transfer_encoding: bytes) -> None:
    # Before, the body reached the app still gzipped.
    request = _chat(transfer_encoding, gzip.compress(CHAT_BODY))
    _assert_refused(gateway, 501, "unsupported_transfer_encoding", request)


@pytest.mark.parametrize(
    ("transfer_encoding", "code"),
    [
        (b"gzip", "invalid_transfer_encoding"),  # refused once the head is complete: named here
        (b"identity", "invalid_transfer_encoding"),
        (b"chunked, gzip", "invalid_http"),  # refused by llhttp while parsing the field, as before
    ],
)
def test_a_transfer_encoding_not_ending_in_chunked_is_400(
    gateway: Gateway, transfer_encoding: bytes, code: str
) -> None:
    _assert_refused(gateway, 400, code, _chat(transfer_encoding, CHAT_BODY))


def test_a_transfer_encoding_in_http_1_0_is_400(gateway: Gateway) -> None:
    # Before, HTTP/1.0 with chunked was read as chunked and served.
    request = _chat(b"chunked", CHAT_BODY, version=b"1.0", host=b"")
    _assert_refused(gateway, 400, "invalid_transfer_encoding", request)


def test_plain_chunked_is_served_and_content_length_with_it_still_invalid(gateway: Gateway) -> None:
    for transfer_encoding in (b"chunked", b"Chunked", b" , chunked"):
        answer = _exchange(gateway, _chat(transfer_encoding, CHAT_BODY))
        assert parse_answers(answer).statuses == (503,), answer[:300]
        assert b'"code":"no_worker_available"' in answer  # the app read the JSON body
    both = _chat(b"chunked", CHAT_BODY).replace(b"Connection:", b"Content-Length: 3\r\nConnection:")
    _assert_refused(gateway, 400, "invalid_http", both)


def test_trailer_fields_do_not_count_toward_the_next_head(gateway: Gateway) -> None:
    # A Host in a chunked body's trailer comes after its head was checked.
    trailer = b"Host: other\r\n\r\n"
    first = _chat(b"chunked", CHAT_BODY).replace(b"Connection: close\r\n", b"")[: -len(b"\r\n")]
    answer = _exchange(
        gateway, first + trailer, HEALTHZ.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    )
    assert parse_answers(answer).statuses == (503, 200)


@pytest.mark.parametrize(
    ("refused", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
        (_chat(b"gzip, chunked", CHAT_BODY).replace(b"Connection: close\r\n", b""), 501),
    ],
)
def test_a_request_pipelined_behind_a_refused_one_is_not_answered(
    gateway: Gateway, refused: bytes, status: int
) -> None:
    answers = parse_answers(_exchange(gateway, refused, HEALTHZ, HEALTHZ))
    assert answers.statuses == (status,) and answers.last_closes and answers.trailing_bytes == 0
