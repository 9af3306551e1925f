"""An answer given from the headers alone (here a 401 for a wrong key) on a keep-alive connection,
against a real gateway process over real sockets (`gateway/http_linger.py`,
`close_if_body_withheld`): the client's next request on that connection is answered, or the
gateway says it closes the connection and does; it is never read as the body it announced.

A client that asked for `100 Continue` and got a final answer instead may withhold its body (RFC
9110, 10.1.1): that answer carries `connection: close` and the connection ends with a lingering
close. A client that did not ask sends its body, which is read and dropped, and the connection
serves its next request. `body_timeout_s` is long here: a connection that waited on the body
would outlast the clients' read timeout and fail the test, not pass it late.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import orjson
import pytest

from gateway.http_linger import LINGER_S
from tests.support.processes import LoneGateway as Gateway
from tests.support.processes import lone_gateway

pytestmark = pytest.mark.e2e

BODY_TIMEOUT_S = 120.0
READ_TIMEOUT_S = LINGER_S + 20  # a linger ends in LINGER_S; the body deadline far later
BODY = b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1}'
VERSION = b"GET /version HTTP/1.1\r\nHost: k\r\n\r\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with lone_gateway(tmp_path_factory.mktemp("early_answer"), {"body_timeout_s": BODY_TIMEOUT_S}) as gw:
        yield gw


def _post_head(*, expect: bool) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: k\r\nAuthorization: Bearer wrong\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
        + ("Expect: 100-continue\r\n" if expect else "")
        + "\r\n"
    ).encode()


class Client:
    """One connection, read answer by answer (each framed by its `content-length`)."""

    def __init__(self, gateway: Gateway) -> None:
        self.sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=READ_TIMEOUT_S)
        self._buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"nothing from the gateway for {READ_TIMEOUT_S} s") from None
        except ConnectionResetError:
            raise AssertionError("the gateway reset the connection") from None

    def answer(self) -> tuple[bytes, bytes]:
        """The next answer's head (lowercased) and body."""
        while b"\r\n\r\n" not in self._buffer:
            chunk = self._recv()
            assert chunk, f"the connection ended before an answer: {self._buffer!r}"
            self._buffer += chunk
        head, _, rest = self._buffer.partition(b"\r\n\r\n")
        head = head.lower()
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:")
        )
        while len(rest) < length:
            chunk = self._recv()
            assert chunk, "the connection ended inside an answer"
            rest += chunk
        self._buffer = rest[length:]
        return head, rest[:length]

    def rest(self) -> bytes:
        """Everything until the gateway's FIN."""
        data = self._buffer
        while chunk := self._recv():
            data += chunk
        return data


@pytest.fixture
def client(gateway: Gateway) -> Iterator[Client]:
    client = Client(gateway)
    try:
        yield client
    finally:
        client.close()


def _refused_for_its_key(head: bytes, body: bytes) -> bool:
    return head.startswith(b"http/1.1 401 ") and orjson.loads(body)["error"]["code"] == "invalid_api_key"


def test_a_client_withholding_its_body_after_the_answer_is_told_the_connection_closes(
    client: Client,
) -> None:
    client.send(_post_head(expect=True))
    head, body = client.answer()  # no `100 Continue`: the key is refused from the headers
    assert _refused_for_its_key(head, body)
    assert b"\r\nconnection: close" in head
    # The body withheld, as the final answer allows; a client reusing the connection anyway
    # gets the end of it, not a silence until the body's deadline.
    client.send(VERSION)
    assert client.rest() == b""


def test_a_client_sending_its_body_after_the_answer_after_all_reads_no_reset(client: Client) -> None:
    client.send(_post_head(expect=True))
    head, body = client.answer()
    assert _refused_for_its_key(head, body) and b"\r\nconnection: close" in head
    client.send(BODY + VERSION)  # read and dropped by the linger
    assert client.rest() == b""


def test_a_client_not_asking_for_100_continue_sends_its_body_and_keeps_the_connection(
    client: Client,
) -> None:
    client.send(_post_head(expect=False))
    head, body = client.answer()  # answered before its body was sent
    assert _refused_for_its_key(head, body) and b"connection: close" not in head
    client.send(BODY + VERSION)  # the body announced, read and dropped; then the next request
    head, body = client.answer()
    assert head.startswith(b"http/1.1 200 ") and "version" in orjson.loads(body)
