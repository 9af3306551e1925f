"""A worker's stream whose lines end with CRLF or a bare CR (SSE allows both, and LF, mixed in one
stream; a worker behind a proxy, or another OpenAI-compatible server, may send them) reads as its
LF twin: the relay forwards the same events in the gateway's LF framing, and finds the same usage,
end, error and content count, however the bytes are cut into reads, between a CR and its LF too.

Before, the relay looked for events only at LF LF: a CRLF stream gave the client nothing and ended
as a 502 ("worker stream ended before its last event")."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.pd_legs import PdRelay
from gateway.sse import Relay, SseRelay, first_event_problem
from gateway.sse_named import MessagesRelay, ResponsesRelay

LINE_ENDS = (b"\r\n", b"\n", b"\r")


def _data(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _named(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\n" + _data({"type": kind, **obj})


def _delta(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
# A vLLM chat stream, with a comment line first and its usage chunk's data on two lines.
CHAT = b"".join(
    [
        b": keep-alive\n\n",
        _data({"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        *(_data(_delta(t)) for t in ("a", "b")),
        _data(_delta("c", "stop")),
        b'data: {"id": "c1", "choices": null,\ndata: "usage": ' + orjson.dumps(USAGE) + b"}\n\n",
        b"data: [DONE]\n\n",
    ]
)
CHAT_ERROR = (
    _data(_delta("a")) + _data({"error": {"message": "engine died", "code": 500}}) + _data(_delta("b"))
)
RESPONSES = b"".join(
    [
        _named("response.created", {"response": {"id": "resp_1"}, "sequence_number": 0}),
        *(
            _named("response.output_text.delta", {"delta": t, "sequence_number": i})
            for i, t in enumerate("ab", 1)
        ),
        _named("response.completed", {"response": {"id": "resp_1", "usage": {"input_tokens": 9}}}),
    ]
)
MESSAGES = b"".join(
    [
        _named("message_start", {"message": {"id": "m1", "usage": {"input_tokens": 9, "output_tokens": 0}}}),
        *(_named("content_block_delta", {"index": 0, "delta": {"text": t}}) for t in "ab"),
        _named("message_delta", {"usage": {"output_tokens": 2}}),
        _named("message_stop", {}),
        b"data: [DONE]\n\n",  # vLLM's stray one after the end, never forwarded
    ]
)


def _pd_relay() -> PdRelay:
    relay = PdRelay(strip_usage=True)
    relay.cached_tokens = 7  # the prefill worker's hit replaces the decode worker's
    return relay


# Each relay that reads a worker's stream, with a stream in its format.
CASES: dict[str, tuple[Callable[[], Relay], bytes]] = {
    "chat": (lambda: SseRelay(strip_usage=False), CHAT),
    "chat, usage stripped": (lambda: SseRelay(strip_usage=True), CHAT),
    "chat, worker error": (lambda: SseRelay(strip_usage=False), CHAT_ERROR),
    "pd decode": (_pd_relay, CHAT),
    "responses": (ResponsesRelay, RESPONSES),
    "messages": (MessagesRelay, MESSAGES),
}


def _framed(stream: bytes, ends: Iterator[bytes]) -> bytes:
    """`stream` (LF-framed) with each line end the next of `ends`."""
    lines = stream.split(b"\n")
    return b"".join(line + next(ends) for line in lines[:-1]) + lines[-1]


def _mixed() -> Iterator[bytes]:
    # Never a CR followed by an LF line end: that pair is one CRLF line end.
    return itertools.cycle(LINE_ENDS)


FRAMINGS: dict[str, Callable[[], Iterator[bytes]]] = {
    "crlf": lambda: itertools.repeat(b"\r\n"),
    "cr": lambda: itertools.repeat(b"\r"),
    "mixed": _mixed,
}


def _state(relay: Relay) -> tuple[Any, ...]:
    error = relay.error
    return (relay.done, relay.usage, relay.content_events, error and error.message, relay.response_id)


def _relayed(make: Callable[[], Relay], pieces: Sequence[bytes]) -> tuple[bytes, tuple[Any, ...]]:
    relay = make()
    out = b"".join(relay.feed(piece) for piece in pieces)
    return out, _state(relay)


def _lf_twin(case: str) -> tuple[bytes, tuple[Any, ...]]:
    """What the relay makes of the LF stream: the reference, checked to be a whole reading."""
    make, stream = CASES[case]
    out, state = _relayed(make, [stream])
    done, usage, content, error, _ = state
    assert out.endswith(b"\n\n") and first_event_problem(out) is None
    assert (done and usage and content >= 2) or (error and content == 1)
    return out, state


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_stream_read_whole_is_its_lf_twin(case: str, framing: str) -> None:
    make, stream = CASES[case]
    framed = _framed(stream, FRAMINGS[framing]())
    assert _relayed(make, [framed]) == _lf_twin(case)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_stream_cut_in_two_at_any_byte_is_its_lf_twin(case: str, framing: str) -> None:
    make, stream = CASES[case]
    framed = _framed(stream, FRAMINGS[framing]())
    twin = _lf_twin(case)
    for cut in range(len(framed) + 1):
        assert _relayed(make, [framed[:cut], framed[cut:]]) == twin, (cut, framed[cut - 2 : cut + 2])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_stream_read_a_byte_at_a_time_is_its_lf_twin(case: str, framing: str) -> None:
    make, stream = CASES[case]
    framed = _framed(stream, FRAMINGS[framing]())
    assert _relayed(make, [framed[i : i + 1] for i in range(len(framed))]) == _lf_twin(case)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    case=st.sampled_from(sorted(CASES)),
    ends=st.lists(st.sampled_from(LINE_ENDS), min_size=1),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_any_mix_of_line_ends_cut_anywhere_is_its_lf_twin(
    case: str, ends: list[bytes], cuts: list[int]
) -> None:
    make, stream = CASES[case]
    # A CR line end followed by an LF one would be one CRLF line end: that LF becomes a CRLF.
    # (`ends` repeats, so the last one comes before the first.)
    after = zip(ends[-1:] + ends[:-1], ends, strict=True)
    chosen = [b"\r\n" if end == b"\n" and prev == b"\r" else end for prev, end in after]
    framed = _framed(stream, itertools.cycle(chosen))
    bounds = [0, *sorted(c for c in cuts if c < len(framed)), len(framed)]
    assert _relayed(make, [framed[a:b] for a, b in itertools.pairwise(bounds)]) == _lf_twin(case)


def test_a_bare_cr_event_goes_out_without_waiting_for_the_next_read() -> None:
    """Its last CR may be the first half of a CRLF, but it ends the line either way."""
    relay = SseRelay(strip_usage=False)
    event = _data(_delta("a"))
    assert relay.feed(event.replace(b"\n", b"\r")) == event
    assert relay.feed(b"\n" + _data(_delta("b")).replace(b"\n", b"\r\n")) == _data(_delta("b"))


def test_an_lf_after_a_cr_that_ended_the_last_read_ends_no_second_line() -> None:
    """CR | LF across two reads is one line end: the event's two data lines stay one event."""
    relay = SseRelay(strip_usage=False)
    assert relay.feed(b'data: {"id": "c1",\r') == b""
    out = relay.feed(b'\ndata: "choices": [], "usage": {"prompt_tokens": 9}}\r\n\r\n')
    assert out == b'data: {"id": "c1",\ndata: "choices": [], "usage": {"prompt_tokens": 9}}\n\n'
    assert relay.usage == {"prompt_tokens": 9}


def test_an_lf_stream_is_forwarded_byte_for_byte() -> None:
    chat = _data(_delta("a")) + _data(_delta("b", "stop")) + b"data: [DONE]\n\n"
    assert _relayed(lambda: SseRelay(strip_usage=False), [chat])[0] == chat
    assert _relayed(ResponsesRelay, [RESPONSES])[0] == RESPONSES
