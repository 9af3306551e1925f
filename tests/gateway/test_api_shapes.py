"""Units of the per-API pieces: named-event relays, multipart fields, usage in every shape,
Anthropic's error envelope."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway import anthropic
from gateway.answer_usage import usage_of
from gateway.errors import ApiError
from gateway.multipart import form_fields
from gateway.sse_named import MessagesRelay, ResponsesRelay


def _event(kind: str, **data: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


RESPONSE_STREAM = b"".join(
    (
        _event("response.created", response={"id": "resp_7", "usage": None, "error": None}),
        _event("response.output_text.delta", delta='text with "response.completed" inside'),
        _event("response.completed", response={"id": "resp_7", "usage": {"input_tokens": 9}}),
        b"data: [DONE]\n\n",
    )
)


def _feed_bytewise(relay: ResponsesRelay | MessagesRelay, stream: bytes) -> bytes:
    return b"".join(relay.feed(stream[i : i + 1]) for i in range(len(stream)))


def test_a_responses_relay_forwards_whole_events_and_notes_id_usage_and_end() -> None:
    whole, pieces = ResponsesRelay(), ResponsesRelay()
    out = whole.feed(RESPONSE_STREAM)
    assert (
        out
        == _feed_bytewise(pieces, RESPONSE_STREAM)
        == RESPONSE_STREAM[: RESPONSE_STREAM.index(b"data: [DONE]")]
    )
    for relay in (whole, pieces):
        assert relay.done and relay.error is None and relay.response_id == "resp_7"
        assert relay.usage == {"input_tokens": 9}
        assert relay.feed(b"data: more\n\n") == b""  # nothing after the terminal event


def test_a_responses_error_event_is_rewritten_and_bounded() -> None:
    relay = ResponsesRelay()
    head = _event("response.created", response={"id": "r"})
    out = relay.feed(head + _event("error", code=500, message="x" * 5000, param="p") + _event("x"))
    assert out.startswith(head)
    error = orjson.loads(out[len(head) :].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["code"] == "upstream_stream_error" and error["param"] == "p"
    assert len(error["message"].encode()) <= 1024 and error["sequence_number"] == 1
    assert relay.closing("gone", "bad_gateway") == b""  # the client already has its one error


def test_a_failed_response_is_a_worker_error() -> None:
    relay = ResponsesRelay()
    out = relay.feed(
        _event("response.failed", response={"error": {"message": "oom", "code": "server_error"}})
    )
    assert relay.error is not None and b'"message":"oom"' in out and b"response.failed" not in out


def test_a_messages_relay_merges_usage_and_drops_a_stray_done() -> None:
    stream = b"".join(
        (
            _event(
                "message_start",
                message={"usage": {"input_tokens": 3, "cache_read_input_tokens": 32, "output_tokens": 0}},
            ),
            _event("ping"),
            _event("content_block_delta", delta={"text": 'the word "message_stop"'}),
            _event("message_delta", usage={"output_tokens": 5, "input_tokens": None}),
            _event("message_stop"),
            b"data: [DONE]\n\n",
        )
    )
    relay = MessagesRelay()
    out = _feed_bytewise(relay, stream)
    assert relay.done and out.endswith(_event("message_stop")) and b"[DONE]" not in out
    assert relay.usage == {"input_tokens": 3, "cache_read_input_tokens": 32, "output_tokens": 5}
    usage = usage_of(relay.usage)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (35, 32, 5)


def test_a_messages_relay_ends_in_anthropics_error_event() -> None:
    relay = MessagesRelay()
    tail = relay.closing("worker stream failed", "upstream_stream_error")
    assert tail.startswith(b"event: error\ndata: ") and tail.endswith(b"\n\n")
    assert orjson.loads(tail[len(b"event: error\ndata: ") :]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "worker stream failed"},
    }
    out = relay.feed(_event("error", error={"type": "overloaded_error", "message": "busy"}))
    assert orjson.loads(out.split(b"data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }
    assert relay.closing("x", "y") == b""


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}},
            (9, 2, 4),
        ),
        ({"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 2}, (9, 2, 4)),
        (
            {
                "input_tokens": 3,
                "cache_read_input_tokens": 4,
                "cache_creation_input_tokens": 2,
                "output_tokens": 1,
            },
            (9, 1, 4),
        ),
        ({"input_tokens": 9, "output_tokens": 1}, (9, 1, None)),  # vLLM versions without cache fields
        ({"type": "duration", "seconds": 3}, (None, None, None)),
        (None, (None, None, None)),
    ],
)
def test_usage_in_every_shape(raw: Any, expected: tuple[int | None, ...]) -> None:
    usage = usage_of(raw)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == expected


def _form(boundary: str, *parts: bytes) -> bytes:
    return (
        b"".join(b"--" + boundary.encode() + b"\r\n" + p + b"\r\n" for p in parts)
        + b"--"
        + boundary.encode()
        + b"--\r\n"
    )


def test_form_fields_reads_named_text_fields_and_skips_files() -> None:
    body = _form(
        "b'(1)",
        b'Content-Disposition: form-data; name="file"; filename="model"\r\n\r\nRIFF model=bad',
        b'Content-Disposition: form-data; name="model"\r\n\r\nwhisper',
        b'Content-Disposition: form-data; name="language"\r\n\r\nen',
        b"\r\norphan part without headers",
        b'content-disposition: form-data; name="stream"\r\nContent-Type: text/plain\r\n\r\ntrue',
    )
    fields = form_fields(body, 'multipart/form-data; boundary="b\'(1)"', frozenset({"model", "stream"}))
    assert fields == {"model": "whisper", "stream": "true"}


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"{}", "application/json"),
        (b"{}", None),
        (_form("zz", b"x"), "multipart/form-data"),  # no boundary
        (_form("zz", b"x"), "multipart/form-data; boundary=a\x01b"),
        (
            b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm',
            "multipart/form-data; boundary=zz",
        ),
        (b"no delimiter at all", "multipart/form-data; boundary=zz"),
        (
            _form("zz", b'Content-Disposition: form-data; name="model"\r\n\r\n\xff'),
            "multipart/form-data; boundary=zz",
        ),
    ],
)
def test_a_malformed_form_is_a_400(body: bytes, content_type: str | None) -> None:
    with pytest.raises(ApiError) as info:
        form_fields(body, content_type, frozenset({"model"}))
    assert info.value.status == 400


def test_anthropic_errors_keep_status_headers_and_the_workers_message() -> None:
    err = ApiError(429, "slow down", "rate_limit_error", "rate_limit_exceeded", None, {"retry-after": "2"})
    resp = anthropic.error_response(err, "rid")
    assert resp.status == 429 and (b"retry-after", b"2") in resp.headers
    assert orjson.loads(resp.body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    worker = orjson.dumps({"error": {"message": "bad param", "type": "BadRequestError", "code": 400}})
    assert orjson.loads(anthropic.normalize_worker_error(422, worker)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad param"},
    }
    assert anthropic.error_type(502) == "api_error" and anthropic.error_type(503) == "overloaded_error"
