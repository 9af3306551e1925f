"""On real processes: a whole answer counts against `limits.max_buffered_answer_bytes` until it
has been written to its client, not only while it is read. A client that does not read its
answer keeps it reserved (another answer that would pass the budget meanwhile gets 503), and the
reservation comes back once the client has read it, once the client has gone, or once it has read
nothing for `limits.send_timeout_s`."""

from __future__ import annotations

import contextlib
import re
import socket
import socketserver
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest

from tests.e2e.harness import Proc, free_port, start_gateway, tenant, write_gateway_config
from tests.support.wait import wait_until_sync

MIB = 1024 * 1024
# Larger than what the kernel's socket buffers take from a client that reads nothing, so most of
# an unread answer stays in the gateway; two do not fit in the budget.
ANSWER = orjson.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * (16 * MIB)}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
BUDGET_BYTES = 24 * MIB
REQUEST = orjson.dumps({"model": "m-big", "messages": [{"role": "user", "content": "x"}]})


class _Worker(socketserver.BaseRequestHandler):
    """Answers its health check, and every POST with `ANSWER` (one request per connection)."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        if head.startswith(b"GET"):
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            return
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            body += sock.recv(65536)
        answer_head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        with contextlib.suppress(OSError):  # the gateway refused the answer and hung up
            sock.sendall(answer_head + b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)


@dataclass
class Stack:
    host: str
    port: int
    metrics_url: str

    def held_bytes(self) -> float:
        return self.metric(r"kvgate_answer_bytes_held")

    def metric(self, series: str) -> float:
        page = httpx.get(self.metrics_url + "/metrics", timeout=5).text
        match = re.search(rf"^{series} (\S+)$", page, re.M)
        return float(match.group(1)) if match else 0.0

    def post(self) -> httpx.Response:
        return httpx.post(
            f"http://{self.host}:{self.port}/v1/chat/completions",
            content=REQUEST,
            headers={"authorization": "Bearer sk-acme", "content-type": "application/json"},
            timeout=30,
        )

    def unread(self) -> socket.socket:
        """A client that sends its request, reads its answer's first bytes, then stops reading."""
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((self.host, self.port))
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-acme\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(REQUEST) + REQUEST
        )
        status = b""
        while len(status) < 12:
            status += client.recv(12 - len(status))
        assert status == b"HTTP/1.1 200"  # sent once the answer was read whole
        return client


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _stack(tmp_path_factory, {})


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway that waits one second on a client that reads nothing."""
    yield from _stack(tmp_path_factory, {"send_timeout_s": 1.0})


def _stack(tmp_path_factory: pytest.TempPathFactory, limits: dict[str, float]) -> Iterator[Stack]:
    worker = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Worker)
    worker.daemon_threads = True
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    gateway: Proc | None = None
    try:
        folder = tmp_path_factory.mktemp("gw-written")
        (folder / "policy.yaml").write_text("policy: round_robin\n")
        pools = [
            {
                "name": "big",
                "models": ["m-big"],
                "workers": [f"http://127.0.0.1:{worker.server_address[1]}"],
                "retry_attempts": 0,
            }
        ]
        config = write_gateway_config(
            folder / "gateway.yaml",
            pools,
            [tenant("acme", "sk-acme")],
            policy_file="policy.yaml",
            limits={"max_buffered_answer_bytes": BUDGET_BYTES, **limits},
        )
        port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, port, metrics_port)
        yield Stack("127.0.0.1", port, f"http://127.0.0.1:{metrics_port}")
    finally:
        if gateway is not None:
            gateway.stop()
        worker.shutdown()
        worker.server_close()


def test_an_unread_answer_stays_reserved_until_its_client_has_read_it(stack: Stack) -> None:
    with stack.unread() as client:
        wait_until_sync(lambda: stack.held_bytes() == len(ANSWER), what="the unread answer held")
        refused = stack.post()  # a second answer would pass the budget while the first is unwritten
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "gateway_overloaded"
        received = b"HTTP/1.1 200"
        while len(received.partition(b"\r\n\r\n")[2]) < len(ANSWER):
            data = client.recv(MIB)
            assert data, "the gateway closed the connection before the end of the answer"
            received += data
        assert received.partition(b"\r\n\r\n")[2] == ANSWER
    wait_until_sync(lambda: stack.held_bytes() == 0, what="the budget back to 0 once written")
    served = stack.post()
    assert served.status_code == 200 and served.content == ANSWER
    wait_until_sync(lambda: stack.held_bytes() == 0, what="the budget back to 0")


def test_a_client_gone_mid_write_gives_its_answer_back(stack: Stack) -> None:
    client = stack.unread()
    wait_until_sync(lambda: stack.held_bytes() == len(ANSWER), what="the unread answer held")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # a reset, with most of the answer unwritten
    wait_until_sync(lambda: stack.held_bytes() == 0, what="the budget back to 0 once the client left")
    assert stack.post().status_code == 200


def test_a_client_that_reads_nothing_is_cut_off_at_the_send_timeout(impatient: Stack) -> None:
    with impatient.unread() as client:
        wait_until_sync(lambda: impatient.held_bytes() == len(ANSWER), what="the unread answer held")
        timed_out = r'kvgate_client_refusals_total\{reason="send_timeout"\}'
        wait_until_sync(lambda: impatient.metric(timed_out) == 1, what="the connection aborted")
        wait_until_sync(lambda: impatient.held_bytes() == 0, what="the budget back to 0")
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while data := client.recv(MIB):
                received += len(data)
        assert received < len(ANSWER)  # what the kernel had taken, then the end: not the answer
    served = impatient.post()  # the budget is free for the next answer
    assert served.status_code == 200 and served.content == ANSWER
