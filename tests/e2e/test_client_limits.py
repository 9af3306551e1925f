"""What a client controls before it is admitted stays bounded, against a real gateway process with
short deadlines: header size and count, the time to send headers and body, idle connections; one
tenant's partial bodies hold only its own share; tpm follows the worker's token counts."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from loadtest.client_probes import ProbeResult, Target, partial_bodies, slow_headers, unfinished_headers
from tests.e2e.harness import Proc, free_port, start_fake_workers, start_gateway, tenant, write_gateway_config
from tests.support.wait import wait_until, wait_until_sync

MAX_HEADER_BYTES = 4096
MAX_HEADERS = 32
HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 4.0
KEEPALIVE_TIMEOUT_S = 1.0
MAX_IN_FLIGHT = 8
TPM = 1000
WAIT_S = 15.0  # how long a probe waits for the server to act (far beyond every deadline)


@dataclass
class Gateway:
    target: Target
    base_url: str
    metrics_url: str
    proc: Proc


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    ports = [free_port(), free_port()]
    fake = start_fake_workers({p: "ok" for p in ports})
    proc: Proc | None = None
    try:
        folder: Path = tmp_path_factory.mktemp("limits")
        (folder / "policy.yaml").write_text("policy: cost\n")
        metrics_port = free_port()
        config = write_gateway_config(
            folder / "gateway.yaml",
            [{"name": "ok", "models": ["m-ok"], "workers": [f"http://127.0.0.1:{p}" for p in ports]}],
            [
                tenant("a", "sk-a", quotas={"max_concurrent": 3}),
                tenant("b", "sk-b"),
                tenant("tpm", "sk-tpm", quotas={"tpm": TPM}),
            ],
            limits={
                "max_header_bytes": MAX_HEADER_BYTES,
                "max_headers": MAX_HEADERS,
                "header_timeout_s": HEADER_TIMEOUT_S,
                "body_timeout_s": BODY_TIMEOUT_S,
                "keepalive_timeout_s": KEEPALIVE_TIMEOUT_S,
                "max_in_flight_requests": MAX_IN_FLIGHT,
            },
            policy_file="policy.yaml",
        )
        port = free_port()
        proc = start_gateway(config, port, metrics_port)
        yield Gateway(
            Target("127.0.0.1", port),
            f"http://127.0.0.1:{port}",
            f"http://127.0.0.1:{metrics_port}/metrics",
            proc,
        )
    finally:
        if proc is not None:
            proc.stop()
        fake.stop()


def _counter(gateway: Gateway, series: str) -> float:
    """The value of one series of the gateway's metrics (0 when it does not exist yet)."""
    for line in httpx.get(gateway.metrics_url, timeout=5).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _refusals(gateway: Gateway, reason: str) -> float:
    return _counter(gateway, f'kvgate_client_refusals_total{{reason="{reason}"}}')


def _refused_requests(gateway: Gateway) -> float:
    """Chat requests answered before they were tied to a model (401, 413, 429, 503, ...)."""
    text = httpx.get(gateway.metrics_url, timeout=5).text
    prefix = 'kvgate_requests_total{endpoint="chat",model="",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_an_oversized_unfinished_head_is_431_and_closed(gateway: Gateway) -> None:
    # Sent whole, then held open: the server reads it all, so its answer is not lost to a reset.
    results = asyncio.run(
        unfinished_headers(gateway.target, connections=4, header_bytes=2 * MAX_HEADER_BYTES, timeout_s=WAIT_S)
    )
    assert [r.status for r in results] == [431] * 4
    assert all(r.closed_after_s is not None for r in results)
    assert _refusals(gateway, "header_too_large") >= 4


def test_a_flood_of_header_bytes_is_cut_off(gateway: Gateway) -> None:
    flood = 64 * 1024 * 1024
    results = asyncio.run(
        unfinished_headers(gateway.target, connections=4, header_bytes=flood, timeout_s=WAIT_S)
    )
    # Closed long before the flood was sent: the server stopped reading past its limit, and what
    # the client could still send fit in the kernel's socket buffers (a few MiB on loopback).
    assert all(r.closed_after_s is not None and r.sent_bytes < flood // 2 for r in results)


def _head(size: int, path: str = "/healthz", extra: bytes = b"") -> bytes:
    """A request head of exactly `size` bytes, padded with one header field."""
    start = f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + extra + b"X-Fill: "
    head = start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"
    assert len(head) == size
    return head


def _response(sock: socket.socket, pending: bytearray) -> tuple[int, bytes]:
    """The next response on `sock` (status, body); bytes read past it stay in `pending`."""
    while b"\r\n\r\n" not in pending:
        data = sock.recv(65536)
        assert data, f"closed before a response; got {bytes(pending)!r}"
        pending += data
    head, _, _ = bytes(pending).partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    end = len(head) + 4 + int(fields[b"content-length"])
    while len(pending) < end:
        data = sock.recv(65536)
        assert data, "closed inside a response body"
        pending += data
    body = bytes(pending[len(head) + 4 : end])
    del pending[:end]
    return int(head.split()[1]), body


def _exchange(gateway: Gateway, *writes: bytes, responses: int = 1) -> tuple[list[tuple[int, bytes]], bool]:
    """Sends `writes` on one connection, one `sendall` each; the first `responses` answers, and
    whether the server then closed the connection (it is keep-alive otherwise)."""
    with socket.create_connection((gateway.target.host, gateway.target.port), timeout=WAIT_S) as sock:
        for data in writes:
            sock.sendall(data)
        pending = bytearray()
        answers = [_response(sock, pending) for _ in range(responses)]
        sock.shutdown(socket.SHUT_WR)  # a server that keeps the connection waits; one that closed reads EOF
        closed_first = not pending and sock.recv(1) == b""
        return answers, closed_first


def _assert_too_large(answer: tuple[int, bytes]) -> None:
    status, body = answer
    assert status == 431
    assert orjson.loads(body)["error"]["code"] == "header_too_large"


def test_a_whole_head_over_the_limit_in_one_write_is_431_and_closed(gateway: Gateway) -> None:
    before = _refusals(gateway, "header_too_large")
    for size in (MAX_HEADER_BYTES + 1, 2 * MAX_HEADER_BYTES, 25 * MAX_HEADER_BYTES):
        [answer], closed = _exchange(gateway, _head(size))
        _assert_too_large(answer)
        assert closed
    assert _refusals(gateway, "header_too_large") >= before + 3


def test_a_head_exactly_at_the_limit_is_served(gateway: Gateway) -> None:
    [(status, _)], _ = _exchange(gateway, _head(MAX_HEADER_BYTES))
    assert status == 200


def test_a_head_over_the_limit_finished_by_a_second_write_is_431(gateway: Gateway) -> None:
    head = _head(MAX_HEADER_BYTES + 100)
    [answer], closed = _exchange(gateway, head[: MAX_HEADER_BYTES - 200], head[MAX_HEADER_BYTES - 200 :])
    _assert_too_large(answer)
    assert closed


def test_an_oversized_head_after_a_good_request_on_a_keepalive_connection_is_431(gateway: Gateway) -> None:
    with socket.create_connection((gateway.target.host, gateway.target.port), timeout=WAIT_S) as sock:
        pending = bytearray()
        sock.sendall(_head(MAX_HEADER_BYTES))
        assert _response(sock, pending)[0] == 200
        sock.sendall(_head(MAX_HEADER_BYTES + 1))
        _assert_too_large(_response(sock, pending))
        assert sock.recv(1) == b""


def test_pipelined_heads_are_bounded_one_by_one(gateway: Gateway) -> None:
    # Two heads at the limit in one write: together over it, each within it.
    answers, _ = _exchange(gateway, _head(MAX_HEADER_BYTES) * 2, responses=2)
    assert [status for status, _ in answers] == [200, 200]
    # An oversized head right behind a request whose answer is not out yet: no 431 can be written
    # in front of that answer, so the connection is only closed.
    before = _refusals(gateway, "header_too_large")
    with socket.create_connection((gateway.target.host, gateway.target.port), timeout=WAIT_S) as sock:
        sock.sendall(_head(100) + _head(MAX_HEADER_BYTES + 1000))
        assert sock.recv(65536) == b""
    assert _refusals(gateway, "header_too_large") == before + 1


def test_body_bytes_read_with_the_head_do_not_count(gateway: Gateway) -> None:
    content = "tokens " * (2 * MAX_HEADER_BYTES // 7)
    body = orjson.dumps({"model": "m-ok", "messages": [{"role": "user", "content": content}]})
    extra = b"Authorization: Bearer sk-b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(
        body
    )
    head = _head(MAX_HEADER_BYTES, "/v1/chat/completions", extra).replace(b"GET", b"POST", 1)
    head = head[:-5] + b"\r\n\r\n"  # one byte longer for "POST": at the limit again
    assert len(head) == MAX_HEADER_BYTES and len(body) > MAX_HEADER_BYTES
    [(status, _)], _ = _exchange(gateway, head + body)
    assert status == 200


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    ],
)
def test_a_request_that_is_not_http_is_a_400_in_the_error_shape_and_closed(
    gateway: Gateway, request_bytes: bytes
) -> None:
    before = _refusals(gateway, "invalid_http")
    [(status, body)], closed = _exchange(gateway, request_bytes)
    assert status == 400 and orjson.loads(body)["error"]["code"] == "invalid_http"
    assert closed
    assert _refusals(gateway, "invalid_http") == before + 1
    assert httpx.get(gateway.base_url + "/healthz", timeout=5).is_success


def test_too_many_header_fields_is_431(gateway: Gateway) -> None:
    headers = {f"x-h{i}": "v" for i in range(MAX_HEADERS + 1)}
    resp = httpx.get(gateway.base_url + "/healthz", headers=headers, timeout=5)
    assert resp.status_code == 431
    assert resp.json()["error"]["code"] == "too_many_headers"
    assert httpx.get(
        gateway.base_url + "/healthz", headers=dict(list(headers.items())[:8]), timeout=5
    ).is_success


def test_slow_headers_are_closed_at_the_header_deadline(gateway: Gateway) -> None:
    results = asyncio.run(slow_headers(gateway.target, connections=4, interval_s=0.05, timeout_s=WAIT_S))
    assert all(r.closed_after_s is not None for r in results)
    assert [r.status for r in results] == [408] * 4


def test_a_silent_connection_is_closed(gateway: Gateway) -> None:
    with socket.create_connection((gateway.target.host, gateway.target.port), timeout=WAIT_S) as sock:
        assert sock.recv(1024) == b""  # closed by the server, without an answer


def test_an_idle_keepalive_connection_is_closed(gateway: Gateway) -> None:
    with socket.create_connection((gateway.target.host, gateway.target.port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while b'"ok"' not in received:
            received += sock.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")
        assert sock.recv(1024) == b""  # then closed once idle for keepalive_timeout_s


async def _partial_bodies_each_sent_once_open(target: Target, connections: int) -> list[ProbeResult]:
    """Tenant a's partial bodies, one probe per connection, all at once: each connection sends its
    head as soon as it is open. One probe of them all opens every connection before it sends on
    any, and on a starved machine that took longer than HEADER_TIMEOUT_S: the gateway closed the
    first ones unanswered as silent connections (as it should), and they were missing from the
    429s."""
    each = await asyncio.gather(
        *(
            partial_bodies(target, connections=1, api_key="sk-a", model="m-ok", timeout_s=WAIT_S)
            for _ in range(connections)
        )
    )
    return [result for results in each for result in results]


def test_partial_bodies_of_one_tenant_leave_the_others_served(gateway: Gateway) -> None:
    # Tenant a (max_concurrent 3) opens 64 requests whose bodies never finish; the gateway admits
    # at most MAX_IN_FLIGHT requests at once. Meanwhile tenant b's requests must all be served.
    refused_before = _refused_requests(gateway)
    body = {"model": "m-ok", "messages": [{"role": "user", "content": "hello"}]}

    async def scenario() -> tuple[list[int], bool, list[int | None], list[float | None]]:
        probe = asyncio.create_task(_partial_bodies_each_sent_once_open(gateway.target, 64))

        # Every head was seen: those beyond the slots a's requests can hold were refused.
        async def every_extra_head_refused() -> bool:
            refused = await asyncio.to_thread(_refused_requests, gateway)
            return refused >= refused_before + 64 - MAX_IN_FLIGHT

        await wait_until(every_extra_head_refused, WAIT_S, "the heads beyond a's slots were refused")
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as client:
            for _ in range(4):
                batch = [
                    client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-b"})
                    for _ in range(MAX_IN_FLIGHT // 2)
                ]
                statuses += [r.status_code for r in await asyncio.gather(*batch)]
        a_still_held = not probe.done()
        results = await probe
        return statuses, a_still_held, [r.status for r in results], [r.closed_after_s for r in results]

    b_statuses, a_still_held, a_statuses, a_closed = asyncio.run(scenario())
    assert b_statuses == [200] * 16
    assert a_still_held  # b was served while a's bodies were pending
    # Three took a's slots and were ended at the body deadline; the rest were refused at once.
    assert sorted(s or 0 for s in a_statuses) == [408] * 3 + [429] * 61
    assert all(c is not None for c in a_closed)  # every connection closed by the server
    assert _refusals(gateway, "body_timeout") >= 3


def _wait_logged(gateway: Gateway, request_id: str) -> str:
    # Access lines are flushed in batches.
    wait_until_sync(lambda: request_id in gateway.proc.output(), WAIT_S, f"{request_id} is logged")
    return gateway.proc.output()


def test_a_prompt_estimated_at_zero_tokens_is_served_without_a_traceback(gateway: Gateway) -> None:
    resp = httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": "m-ok", "prompt": "hi", "max_tokens": 4},
        headers={"authorization": "Bearer sk-b"},
        timeout=10,
    )
    assert resp.status_code == 200
    log = _wait_logged(gateway, resp.headers["x-request-id"])
    assert "Traceback" not in log and "on_complete failed" not in log


def test_tpm_follows_the_workers_prompt_counts(gateway: Gateway) -> None:
    # The fake worker counts a token per byte of the messages' JSON, about four per estimated one.
    body = {"model": "m-ok", "messages": [{"role": "user", "content": "tokens " * 25}]}
    used = 0
    for _ in range(40):
        resp = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            json=body,
            headers={"authorization": "Bearer sk-tpm"},
            timeout=10,
        )
        if resp.status_code == 429:
            break
        assert resp.status_code == 200
        usage = resp.json()["usage"]
        used += usage["prompt_tokens"] + usage["completion_tokens"]
    else:
        pytest.fail("the tpm quota never ran out")
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    # At most the quota and the one request that was admitted before its count came in.
    assert 0 < used <= TPM * 1.5
