"""A content event whose token is the word `error` or `usage` counts like any other.

The relays look inside an event only when its bytes hold a quoted `"error"` or `"usage"` (a
worker's error, the usage chunk); a token of exactly that text (`log.error(`, `"usage"` in code)
holds one too, as a bare JSON string. Such events were forwarded without being counted, so a
stream cut before its usage was charged less than it delivered. The other way, a chunk that
only closes a choice (SGLang's) is not a token."""

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


def _chunk(index: int, delta: dict[str, object], finish: str | None) -> bytes:
    body = {"id": "c1", "object": "chat.completion.chunk", "model": "m"}
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    return b"data: " + orjson.dumps({**body, "choices": [choice]}) + b"\n\n"


def test_a_choices_closing_chunk_without_a_token_is_not_counted() -> None:
    # SGLang opens each choice with a role chunk and closes it with a chunk of its own that holds
    # no token (its delta empty, or all nulls), after every token; its usage then says 3 a choice.
    for empty in ({}, {"role": None, "content": None, "tool_calls": None}):
        stream = b"".join(_chunk(i, {"role": "assistant", "content": ""}, None) for i in (0, 1))
        stream += b"".join(_chunk(i, {"content": w}, None) for w in ("a", "b", "c") for i in (0, 1))
        stream += b"".join(_chunk(i, empty, "stop") for i in (0, 1))
        for split in (False, True):
            relay = SseRelay(strip_usage=False)
            chunks = [e + b"\n\n" for e in stream.split(b"\n\n") if e] if split else [stream]
            assert b"".join(relay.feed(c) for c in chunks) == stream
            assert relay.content_events == 6  # a lower bound: never more than the 6 tokens sent


def test_vllms_last_token_shares_its_chunk_with_the_finish_and_the_count_stays_below() -> None:
    stream = _chunk(0, {"role": "assistant", "content": ""}, None)
    stream += _chunk(0, {"content": "a"}, None) + _chunk(0, {"content": "b"}, "length")
    relay = SseRelay(strip_usage=False)
    relay.feed(stream)
    assert 1 <= relay.content_events <= 2
