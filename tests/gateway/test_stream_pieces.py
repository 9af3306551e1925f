"""A stream's events reach the client in bounded pieces (`gateway.streaming`)."""

from __future__ import annotations

from typing import Any

from gateway.answer_write import send_in_pieces
from gateway.streaming import STREAM_PIECE_BYTES


async def test_a_large_run_of_events_is_sent_in_pieces_and_a_small_one_whole() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    out = bytes(range(256)) * (3 * STREAM_PIECE_BYTES // 256 + 7)
    await send_in_pieces(send, out, STREAM_PIECE_BYTES, more_body=True)
    assert len(sent) == 4
    assert all(len(m["body"]) <= STREAM_PIECE_BYTES and m["more_body"] for m in sent)
    assert b"".join(m["body"] for m in sent) == out
    sent.clear()
    await send_in_pieces(send, b"data: {}\n\n", STREAM_PIECE_BYTES, more_body=True)
    assert sent == [{"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}]
