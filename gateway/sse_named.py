"""Relays for the streams of named events: OpenAI Responses and Anthropic Messages.

Both APIs stream `event: <type>` + `data: {json}` events with no `[DONE]`: a stream ends with its
terminal event (`response.completed` / `response.incomplete`; `message_stop`), and usage rides
inside events (`response.completed.response.usage`; `message_start.message.usage` merged with
`message_delta.usage`). Like `sse.SseRelay`, these relays are `sse.EventRelay`s: they forward
whole events only and look inside an event only when a byte test says it may matter: the quoted
type names below match only structural JSON, never text inside a string (where the quotes would be
escaped).

A worker's failure inside a stream (`error`, `response.failed`) is never passed on as is: the
client gets one error event in the route's own shape (Responses: `{"type": "error", "code",
"message", "param", "sequence_number"}`; Anthropic: `{"type": "error", "error": {"type",
"message"}}`) with the worker's message bounded, and nothing after it. Events after the terminal
event (vLLM ends its Messages stream with a stray `data: [DONE]`) are dropped.

The content events counted (`sse.Relay.content_events`) are the delta events, one token or more
each: Responses' `response.*.delta` (`output_text`, `reasoning_text`, `function_call_arguments`,
...) and Messages' `content_block_delta`, found by the quoted type name (`CONTENT`), never by the
`event:` line (an event may come without one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from gateway.sse import UNREADABLE_ERROR, EventRelay, data_of, worker_error_of

# Anthropic's error types; a worker's own type outside this set is reported as `api_error`.
ANTHROPIC_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "billing_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "timeout_error",
        "overloaded_error",
    }
)


class NamedEventRelay(EventRelay):
    """Splits a named-event stream into whole events (`sse.EventRelay`); subclasses say which
    events to look inside (`MARKERS`) and what they mean (`_event`). Nothing after the terminal
    event is forwarded."""

    ENDS_AT_TERMINAL = True
    MARKERS: tuple[bytes, ...] = ()
    CONTENT: ClassVar[bytes]  # a content event's quoted type name, or its quoted end
    __slots__ = ("_forwarded", "_last", "response_id")

    def __init__(self) -> None:
        super().__init__()
        self._forwarded = 0  # events forwarded so far (a Responses error event numbers itself after them)
        self._last = b""  # bytes that end with the last event forwarded (read only for an error event)
        self.response_id: str | None = None

    def _events(self, head: bytes) -> bytes:
        if not any(marker in head for marker in self.MARKERS):
            self._forwarded += head.count(b"\n\n")
            self.content_events += head.count(self.CONTENT)
            self._last = head
            return head
        out: list[bytes] = []
        for event in head.split(b"\n\n"):
            if not event:
                continue
            if any(marker in event for marker in self.MARKERS):
                forwarded = self._inspect(event)
                if forwarded is None:  # an error: the client gets ours, and nothing after it
                    out.append(self.error_event())
                    self._pending = b""
                    break
                out.append(forwarded)
            else:
                out.append(event + b"\n\n")
            if self.CONTENT in event:  # inspected too when a delta's text is `"error"`
                self.content_events += 1
            self._forwarded += 1
            self._last = event
            if self.done:
                self._pending = b""  # nothing after the terminal event is part of the answer
                break
        return b"".join(out)

    def _inspect(self, event: bytes) -> bytes | None:
        payload = data_of(event)
        try:
            obj = orjson.loads(payload) if payload is not None else None
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            if b'"error"' in event:
                self.error = UNREADABLE_ERROR
                return None
            return event + b"\n\n"
        kind = obj.get("type")
        if isinstance(kind, str):
            self._event(kind, obj)
        elif obj.get("error") is not None:
            # An OpenAI-style error object (`{"error": {...}}`, no event type): an error on any
            # route, rewritten like the route's own (it may quote the request).
            self.error = worker_error_of(obj["error"])
        return None if self.error is not None else event + b"\n\n"

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        """Note what one inspected event means: usage, an id, the end, or an error."""
        raise NotImplementedError

    def error_event(self, message: str | None = None, code: str | None = None) -> bytes:
        """The route's error event: the worker's (bounded), or one the gateway writes."""
        raise NotImplementedError

    def closing(self, message: str, code: str) -> bytes:
        """What ends a stream that did not reach its terminal event: one error event, unless the
        worker's own was already sent (rewritten). No `[DONE]`: these APIs have none."""
        return b"" if self.error is not None else self.error_event(message, code)


class ResponsesRelay(NamedEventRelay):
    """A Responses stream: the response id from `response.created`, usage and the end from
    `response.completed` / `response.incomplete`, failures from `error` / `response.failed`."""

    MARKERS = (
        b'"response.created"',
        b'"response.completed"',
        b'"response.incomplete"',
        b'"response.failed"',
        b'"error"',
    )
    CONTENT = b'.delta"'
    __slots__ = ()

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        response = obj.get("response")
        response = response if isinstance(response, Mapping) else {}
        if kind == "response.created":
            rid = response.get("id")
            self.response_id = rid if isinstance(rid, str) and rid else None
        elif kind in ("response.completed", "response.incomplete"):
            self.usage = response.get("usage")
            self.done = True
        elif kind == "response.failed":
            self.error = worker_error_of(response.get("error"))
        elif kind == "error":
            self.error = worker_error_of(obj)

    def _next_sequence_number(self) -> int:
        """The `sequence_number` after the last event forwarded: its own plus one (a retrieve
        resumed with `starting_after` starts past 0), or the count of events forwarded when it
        has none."""
        last = self._last.rstrip(b"\n")
        event = last[last.rfind(b"\n\n") + 1 :]
        payload = data_of(event.strip(b"\n"))
        try:
            obj = orjson.loads(payload) if payload is not None else None
        except orjson.JSONDecodeError:
            obj = None
        seq = obj.get("sequence_number") if isinstance(obj, dict) else None
        if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0:
            return seq + 1
        return self._forwarded

    def error_event(self, message: str | None = None, code: str | None = None) -> bytes:
        error = self.error
        data = {
            "type": "error",
            "code": code if code is not None else (error.code if error else None),
            "message": message if message is not None else (error.message if error else ""),
            "param": error.param if error is not None and message is None else None,
            "sequence_number": self._next_sequence_number(),
        }
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


class MessagesRelay(NamedEventRelay):
    """An Anthropic Messages stream: usage from `message_start` and `message_delta`, the end at
    `message_stop`, failures from `error` events."""

    MARKERS = (b'"message_start"', b'"message_delta"', b'"message_stop"', b'"error"')
    CONTENT = b'"content_block_delta"'
    __slots__ = ("_anthropic_type",)

    def __init__(self) -> None:
        super().__init__()
        self._anthropic_type = "api_error"  # the worker's own error type, when it is Anthropic's

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "message_start":
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, Mapping) else None
            if isinstance(usage, Mapping):
                self.usage = dict(usage)
        elif kind == "message_delta":
            usage = obj.get("usage")
            if isinstance(usage, Mapping):
                # Counts that are present and not null replace the start's (output grows).
                merged = dict(self.usage) if isinstance(self.usage, Mapping) else {}
                merged.update({k: v for k, v in usage.items() if v is not None})
                self.usage = merged
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            inner = obj.get("error")
            self.error = worker_error_of(inner)
            wtype = inner.get("type") if isinstance(inner, Mapping) else None
            self._anthropic_type = wtype if wtype in ANTHROPIC_ERROR_TYPES else "api_error"

    def error_event(self, message: str | None = None, code: str | None = None) -> bytes:
        if message is None:
            message = self.error.message if self.error is not None else ""
            type_ = self._anthropic_type
        else:
            type_ = "api_error"
        data = {"type": "error", "error": {"type": type_, "message": message}}
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"
