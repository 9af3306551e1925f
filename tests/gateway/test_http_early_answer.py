"""Answers given before the request's body was read, on a keep-alive connection, driven byte by
byte (`http_limits_rig`; `http_linger.close_if_body_withheld`): the connection is closed after
the answer, with a lingering close, only when the client may withhold the body for good (it asked
for `100 Continue` and got none); otherwise the body is read and dropped and the connection serves
the next request. `test_http_early_answer_process` runs them against a real gateway process."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from tests.gateway.http_limits_rig import GET, Rig, rig, settle

__all__ = ["rig"]  # the fixture


def expecting(length: int) -> bytes:
    return f"POST /x HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: {length}\r\n\r\n".encode()


@dataclass
class Refuses:
    """Answers 401, after reading the first part of the body when `reads_first` (uvicorn then
    writes `100 Continue`), else from the headers alone; later requests are answered 200 once
    their body is read."""

    reads_first: bool = False
    requests: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.requests += 1
        if self.requests > 1:
            while (await receive()).get("more_body", False):
                pass
            status = 200
        else:
            if self.reads_first:
                await receive()
            status = 401
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


def statuses(written: bytearray) -> list[bytes]:
    return [answer.split(b" ", 1)[0] for answer in bytes(written).split(b"HTTP/1.1 ")[1:]]


async def test_an_answer_to_a_client_awaiting_100_continue_closes_with_a_linger(rig: Rig) -> None:
    protocol, transport = rig.serve(Refuses())
    protocol.data_received(expecting(10))
    await settle()
    assert statuses(transport.written) == [b"401"] and b"\r\nconnection: close\r\n" in transport.written
    assert transport.eof and not transport.closed  # lingering: what follows is dropped
    protocol.data_received(b"0123456789" + GET)  # the body after all, or the next request
    await settle()
    assert statuses(transport.written) == [b"401"]
    assert not rig.guard.waiting  # no body deadline left to answer 408 on a lingering connection


async def test_an_answer_after_a_100_continue_keeps_the_connection(rig: Rig) -> None:
    protocol, transport = rig.serve(Refuses(reads_first=True))
    protocol.data_received(expecting(10))
    await settle()
    assert bytes(transport.written) == b"HTTP/1.1 100 Continue\r\n\r\n"  # told to send its body
    protocol.data_received(b"01234")  # the app answers from its first part
    await settle()
    assert statuses(transport.written) == [b"100", b"401"] and b"connection: close" not in transport.written
    protocol.data_received(b"56789" + GET)  # the rest, read and dropped; then the next request
    await settle()
    assert statuses(transport.written) == [b"100", b"401", b"200"] and not transport.ended


async def test_an_answer_after_the_body_arrived_unasked_keeps_the_connection(rig: Rig) -> None:
    protocol, transport = rig.serve(Refuses())
    protocol.data_received(expecting(10) + b"0123456789")  # sent without waiting for the 100
    await settle()
    assert statuses(transport.written) == [b"401"] and b"connection: close" not in transport.written
    protocol.data_received(GET)
    await settle()
    assert statuses(transport.written) == [b"401", b"200"] and not transport.ended
