"""A whole worker answer written to its client while its bytes stay reserved in the answer budget.

`RawResponse` sends its body in one message: uvicorn hands it to the client's transport, which
keeps whatever the client has not read yet, and the send returns at once. An answer given back
to the budget at that point would still be in memory, as long as its client takes to read it,
while the budget lets further answers be read: the process could hold about twice the budget.

`HeldResponse` keeps the answer's `Reservation` until the answer has left the gateway. A body
larger than `WRITE_PIECE_BYTES` goes out in pieces of that size; uvicorn waits before each piece
until the transport's buffer has drained below its low-water mark (its flow control), so once
the last piece has been handed over, at most that piece (and the buffer's high-water mark) is
still in the process. The reservation is then given back, once, however the write ended: written,
the client gone (uvicorn's `send` then returns at once), the send failing, or the task cancelled
(the gateway's drain, a shutdown). A slow client keeps its answer's reservation while it reads:
the memory is the process's as long, and the tenant's share bounds what one tenant's clients can
hold (`answer_budget`). A client that reads nothing is cut off after `limits.send_timeout_s`
(`http_limits`), which ends the write as a client gone.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from gateway.answer_budget import Reservation
from gateway.errors import RawResponse
from gateway.upstream_conn import AnswerBody

# Small enough that what the transport holds after the last piece is negligible next to the
# answers the budget bounds; large enough that a 64 MB answer is a few dozen sends.
WRITE_PIECE_BYTES = 1 << 20


class HeldResponse(RawResponse):
    """A worker's answer passed through as it came (`body` may be the connection's bytearray),
    its reservation (`held`) released once it has been written or the write ended otherwise."""

    __slots__ = ("held",)

    def __init__(
        self, status: int, body: AnswerBody, headers: list[tuple[bytes, bytes]], held: Reservation
    ) -> None:
        super().__init__(status, body, headers)
        self.held = held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = self.body
            headers = [*self.headers, (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": self.status, "headers": headers})
            await send_in_pieces(send, body, WRITE_PIECE_BYTES, more_body=False)
        finally:
            self.body = b""  # not needed any more: its memory goes with its reservation
            self.held.release()


async def send_in_pieces(send: Send, body: AnswerBody, piece_bytes: int, *, more_body: bool) -> None:
    """`body` as ASGI body messages of at most `piece_bytes` each (uvicorn waits for the client
    connection's buffer to drain below its mark before taking the next); `more_body` is the last
    message's flag (False: the response ends with it)."""
    if len(body) <= piece_bytes:
        whole = body if isinstance(body, bytes) else bytes(body)
        message: dict[str, object] = {"type": "http.response.body", "body": whole}
        if more_body:
            message["more_body"] = True
        await send(message)
        return
    with memoryview(body) as view:
        for start in range(0, len(body), piece_bytes):
            end = start + piece_bytes
            last = end >= len(body)
            piece = view[start:end].tobytes()
            await send({"type": "http.response.body", "body": piece, "more_body": more_body or not last})
