"""The SSE relay on its own: whole events, usage rewriting, in-stream errors from workers."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.sse import MAX_STREAM_ERROR_MESSAGE_BYTES, SseRelay


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


CONTENT = _event({"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None})
USAGE = _event(
    {"choices": None, "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}}
)
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_split_anywhere_forwards_whole_events_only(piece: int) -> None:
    relay = SseRelay(strip_usage=False)
    stream = CONTENT * 3 + USAGE + DONE
    out = b""
    for i in range(0, len(stream), piece):
        part = relay.feed(stream[i : i + piece])
        assert part == b"" or part.endswith(b"\n\n")
        out += part
    events = [e for e in out.split(b"\n\n") if e]
    assert events[:3] == [CONTENT[:-2]] * 3 and events[-1] == b"data: [DONE]"
    assert orjson.loads(events[3][6:])["choices"] == []  # null became a list
    assert relay.done and relay.usage["prompt_tokens_details"]["cached_tokens"] == 4


def test_strip_usage_drops_the_usage_only_chunk_but_keeps_the_numbers() -> None:
    relay = SseRelay(strip_usage=True)
    out = relay.feed(CONTENT + USAGE + DONE)
    assert out == CONTENT + DONE
    assert relay.usage["prompt_tokens"] == 5


def test_content_mentioning_usage_or_error_is_untouched() -> None:
    relay = SseRelay(strip_usage=True)
    tricky = _event({"choices": [{"delta": {"content": 'say "usage": {"error" [DONE]'}}], "usage": None})
    assert relay.feed(tricky) == tricky
    assert relay.usage is None and relay.error is None and not relay.done


def test_oversized_partial_event_is_refused() -> None:
    relay = SseRelay(strip_usage=False)
    with pytest.raises(ValueError):
        relay.feed(b"data: " + b"x" * (5 * 1024 * 1024))


# --- in-stream errors from workers -------------------------------------------------------------

VLLM_NESTED = {
    "error": {
        "object": "error",
        "message": "grammar compilation failed",
        "type": "BadRequestError",
        "param": "response_format",
        "code": 400,
        "engine_core": "EngineCoreProc-0",  # an internal field that must not reach the client
    }
}
VLLM_FLAT = {"object": "error", "message": "engine dead", "type": "InternalServerError", "code": 500}
LATER = _event({"choices": [{"index": 0, "delta": {"content": "more"}}], "usage": None})


def _errors(out: bytes) -> list[dict[str, Any]]:
    events = [e for e in out.split(b"\n\n") if e]
    parsed = [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    return [p["error"] for p in parsed if "error" in p]


def _relay_all(stream: bytes, piece: int) -> tuple[SseRelay, bytes]:
    relay = SseRelay(strip_usage=False)
    out = b""
    for i in range(0, len(stream), piece):
        part = relay.feed(stream[i : i + piece])
        assert part == b"" or part.endswith(b"\n\n")
        out += part
    return relay, out


@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        (
            VLLM_NESTED,
            {
                "message": "grammar compilation failed",
                "type": "invalid_request_error",
                "param": "response_format",
                "code": "upstream_stream_error",
            },
        ),
        (
            VLLM_FLAT,
            {
                "message": "engine dead",
                "type": "server_error",
                "param": None,
                "code": "upstream_stream_error",
            },
        ),
        (
            {"error": {"message": "slow down", "type": "rate_limit_error", "code": "rate_limit_exceeded"}},
            {
                "message": "slow down",
                "type": "rate_limit_error",
                "param": None,
                "code": "upstream_stream_error",
            },
        ),
        (
            {"error": "CUDA error: an illegal memory access"},
            {
                "message": "CUDA error: an illegal memory access",
                "type": "server_error",
                "param": None,
                "code": "upstream_stream_error",
            },
        ),
        (
            {"error": {"message": 7, "trace": ["frame"]}},
            {
                "message": "the worker reported an error mid-stream",
                "type": "server_error",
                "param": None,
                "code": "upstream_stream_error",
            },
        ),
    ],
)
@pytest.mark.parametrize("piece", [1, 5, 64, 100_000])
def test_worker_error_becomes_one_event_in_the_gateway_shape(
    worker: dict[str, Any], expected: dict[str, Any], piece: int
) -> None:
    relay, out = _relay_all(CONTENT * 2 + _event(worker) + LATER + DONE, piece)
    # The deltas before the error pass untouched; the error is ours; nothing after it.
    assert out == CONTENT * 2 + b"data: " + orjson.dumps({"error": expected}) + b"\n\n"
    assert relay.error is not None and relay.error.message == expected["message"]
    assert not relay.done  # the worker's [DONE] after its error was not forwarded either
    assert relay.feed(CONTENT + _event(worker) + DONE) == b""


def test_error_in_the_same_chunk_as_deltas_and_the_workers_done() -> None:
    relay = SseRelay(strip_usage=True)
    out = relay.feed(CONTENT + _event(VLLM_FLAT) + USAGE + _event(VLLM_FLAT) + DONE)
    assert out.startswith(CONTENT)
    assert [e["message"] for e in _errors(out)] == ["engine dead"]
    assert out.count(b"data: ") == 2 and relay.usage is None and not relay.done


def test_error_after_a_partial_event_is_kept_whole() -> None:
    relay = SseRelay(strip_usage=False)
    err = _event(VLLM_NESTED)
    assert relay.feed(CONTENT + err[:20]) == CONTENT
    out = relay.feed(err[20:] + CONTENT[:10])
    assert _errors(out)[0]["param"] == "response_format"
    assert relay.feed(CONTENT[10:]) == b""


def test_worker_status_is_recorded_for_accounting_but_not_sent() -> None:
    relay = SseRelay(strip_usage=False)
    out = relay.feed(_event(VLLM_NESTED))
    assert relay.error is not None and relay.error.worker_status == 400 and relay.error.request_rejected
    assert b"400" not in out and b"EngineCore" not in out and b"BadRequestError" not in out
    flat = SseRelay(strip_usage=False)
    flat.feed(_event(VLLM_FLAT))
    assert flat.error is not None and flat.error.worker_status == 500 and not flat.error.request_rejected


@pytest.mark.parametrize(
    "payload",
    [
        b'{"error": {"message": "cut',  # not JSON
        b'{"error": NaN}',  # not JSON either
        b'"error"',  # JSON, not an object
        b'["error", "x"]',
    ],
)
def test_unreadable_error_payloads_become_a_generic_error(payload: bytes) -> None:
    relay = SseRelay(strip_usage=False)
    out = relay.feed(CONTENT + b"data: " + payload + b"\n\n" + LATER)
    assert out.startswith(CONTENT)
    (err,) = _errors(out[len(CONTENT) :])
    assert err == {
        "message": "the worker reported an unreadable error mid-stream",
        "type": "server_error",
        "param": None,
        "code": "upstream_stream_error",
    }
    assert b"data: " + payload + b"\n\n" not in out


def test_huge_error_message_is_truncated_on_a_character_boundary() -> None:
    relay = SseRelay(strip_usage=False)
    out = relay.feed(_event({"error": {"message": "é" * 100_000}}))
    message = _errors(out)[0]["message"]
    assert len(message.encode()) <= MAX_STREAM_ERROR_MESSAGE_BYTES
    assert message.endswith("…") and message.startswith("é" * 500)
    assert len(out) < 2 * MAX_STREAM_ERROR_MESSAGE_BYTES


def test_error_without_space_after_data_and_in_a_multiline_event() -> None:
    relay = SseRelay(strip_usage=False)
    assert _errors(relay.feed(b"data:" + orjson.dumps(VLLM_FLAT) + b"\n\n"))[0]["message"] == "engine dead"
    relay = SseRelay(strip_usage=False)
    out = relay.feed(b"event: error\r\ndata: " + orjson.dumps(VLLM_NESTED) + b"\r\n\n")
    assert _errors(out)[0]["message"] == "grammar compilation failed" and b"event:" not in out


def test_null_error_and_error_tokens_are_ordinary_chunks() -> None:
    relay = SseRelay(strip_usage=False)
    chunks = (
        _event({"choices": [{"delta": {"content": "error"}}], "error": None})
        + _event({"choices": [{"delta": {"content": "x"}, "finish_reason": "error"}]})
        + _event({"choices": [{"logprobs": {"content": [{"token": "error"}]}}]})
    )
    assert relay.feed(chunks) == chunks
    assert relay.error is None


def test_named_events_that_are_not_rewritten_keep_their_lines() -> None:
    relay = SseRelay(strip_usage=True)
    event = b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":{"x":1}}}\n\n'
    assert relay.feed(event) == event and relay.error is None


def test_plain_events_before_the_first_interesting_one_pass_through_untouched() -> None:
    deltas = b"".join(b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i for i in range(20))
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":20}}\n\n'
    relay = SseRelay(strip_usage=True)
    out = relay.feed(deltas + usage + b"data: [DONE]\n\n")
    assert out == deltas + b"data: [DONE]\n\n"  # the usage chunk the client did not ask for is gone
    assert relay.done and relay.usage == {"prompt_tokens": 3, "completion_tokens": 20}
    kept = SseRelay(strip_usage=False)
    assert kept.feed(deltas + usage) == deltas + usage and kept.usage is not None
