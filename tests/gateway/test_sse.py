import orjson
import pytest

from gateway.sse import SseRelay


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


def test_error_event_is_recorded_and_passed_on() -> None:
    relay = SseRelay(strip_usage=False)
    err = _event({"error": {"message": "engine dead", "type": "server_error"}})
    assert relay.feed(CONTENT + err) == CONTENT + err
    assert relay.error["message"] == "engine dead" and not relay.done


def test_content_mentioning_usage_or_error_is_untouched() -> None:
    relay = SseRelay(strip_usage=True)
    tricky = _event({"choices": [{"delta": {"content": 'say "usage": {"error" [DONE]'}}], "usage": None})
    assert relay.feed(tricky) == tricky
    assert relay.usage is None and relay.error is None and not relay.done


def test_oversized_partial_event_is_refused() -> None:
    relay = SseRelay(strip_usage=False)
    with pytest.raises(ValueError):
        relay.feed(b"data: " + b"x" * (5 * 1024 * 1024))
