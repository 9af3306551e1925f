"""A content event whose token is the word `error` or `usage` counts like any other.

The relays look inside an event only when its bytes hold a quoted `"error"` or `"usage"` (a
worker's error, the usage chunk); a token of exactly that text (`log.error(`, `"usage"` in code)
holds one too, as a bare JSON string. Such events were forwarded without being counted, so a
stream cut before its usage was charged less than it delivered."""

from __future__ import annotations

import orjson

from gateway.sse import SseRelay
from gateway.sse_named import MessagesRelay, ResponsesRelay

WORDS = ["error", "usage", "x", "error", "usage"]


def _chat(words: list[str]) -> bytes:
    head = b'{"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":'
    role = b"data: " + head + b'{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    return role + b"".join(
        b"data: " + head + orjson.dumps({"content": w}) + b',"finish_reason":null}]}\n\n' for w in words
    )


def _named(kind: str, data: dict[str, object]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def test_a_chat_token_that_reads_like_a_marker_is_counted() -> None:
    for split in (False, True):
        relay = SseRelay(strip_usage=False)
        stream = _chat(WORDS)
        chunks = [e + b"\n\n" for e in stream.split(b"\n\n") if e] if split else [stream]
        forwarded = b"".join(relay.feed(c) for c in chunks)
        assert forwarded == stream
        assert relay.content_events == len(WORDS)
        assert relay.error is None and relay.usage is None


def test_a_named_delta_that_reads_like_a_marker_is_counted() -> None:
    responses, messages = ResponsesRelay(), MessagesRelay()
    deltas = b"".join(_named("response.output_text.delta", {"delta": w, "item_id": "m1"}) for w in WORDS)
    blocks = b"".join(
        _named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w}}) for w in WORDS
    )
    assert responses.feed(deltas) == deltas
    assert messages.feed(blocks) == blocks
    assert responses.content_events == len(WORDS)
    assert messages.content_events == len(WORDS)
    assert responses.error is None and messages.error is None
