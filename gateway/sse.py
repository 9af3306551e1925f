"""Server-sent-event relay with minimal per-chunk work.

Upstream bytes arrive in arbitrary pieces; the relay forwards whole events only (so a terminal
error event can always be appended cleanly) and looks inside an event only when a cheap byte test
says it may be the usage chunk, `[DONE]` or an in-stream error. SSE lets a line end with CRLF or
a bare CR as well as LF, mixed in one stream (vLLM and SGLang send LF; a proxy in front of a
worker, or another OpenAI-compatible server, may not): the relay makes every line end LF as the
bytes arrive (`EventRelay._lf_framed`), so whatever reads its events, and the client, sees LF
framing only; an LF stream pays one memchr per chunk for it.

A worker reports a failure inside a stream that has already started as a data event: vLLM and
SGLang send `{"error": {"object": "error", "message", "type", "param", "code": 400}}` (newer vLLM
without `object`), older vLLM the same fields at the top level. The relay never forwards that
payload as is: the client gets exactly one event in the gateway's own OpenAI shape
`{"error": {"message", "type", "param", "code"}}` (the worker's message, bounded, and `param`; an
OpenAI `type`; code `upstream_stream_error`), the OpenAI SDKs raise on it, and the relay forwards
nothing after it (the streaming response then adds `[DONE]` and closes).

Each relay counts the content events it forwarded (`content_events`), so a stream that ends
before the worker's usage (its client left, the worker died) is still charged for what it
delivered (`outcome.record_request`). vLLM and SGLang put at least one token in each content
event, so the count is a lower bound on the tokens the client got. It is kept with a byte count
per chunk, no parse: for chat and completions the chunks with `"choices":` (not the usage chunk,
`[DONE]` or an error, which the relay inspects anyway), less the chunks with `"content":""` before
the first token (vLLM opens each choice with one that carries its role and no token), and less
the chunks that carry a `finish_reason`: SGLang ends each choice with a chunk of its own that holds
no token, and vLLM's last token of a choice, which shares its chunk, is then not counted (the count
stays a lower bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.errors import error_body

DONE_EVENT = b"data: [DONE]\n\n"
# Byte patterns of the events the relay must look inside: the end, an error; and a usage chunk,
# its `"usage":` key with any value but null (`_usage_at`).
_MARKERS = (b"data: [DONE]", b'"error"')
_USAGE_KEY = b'"usage":'
_NULL = (b"null", b" null")
_MAX_PENDING_BYTES = 4 * 1024 * 1024
# A CR as an int: `int in bytes` is a memchr, where CPython 3.11 searches for `b"\r"` far slower.
_CR = ord("\r")
# A chunk of the answer, and one that carries no token (vLLM's role chunk opening a choice).
_CHOICES = b'"choices":'
_EMPTY_CONTENT = b'"content":""'
# A choice's end (a `finish_reason` string, not null): SGLang's carries no token.
_FINISHED = b'"finish_reason":"'

STREAM_ERROR_CODE = "upstream_stream_error"
# Bounds on what a worker's error puts in front of the client (UTF-8 bytes / characters).
MAX_STREAM_ERROR_MESSAGE_BYTES = 1024
_MAX_PARAM_CHARS = 256
_TRUNCATED = "…"
_GENERIC_MESSAGE = "the worker reported an error mid-stream"
_UNREADABLE_MESSAGE = "the worker reported an unreadable error mid-stream"
# OpenAI's error types; a worker's own (vLLM says "BadRequestError") is not passed on.
OPENAI_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "insufficient_quota",
        "server_error",
    }
)


class MalformedStream(ValueError):
    """The worker's stream is not a stream of SSE events the relay can forward."""


def error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    return b"data: " + error_body(message, type_, code) + b"\n\n"


@dataclass(frozen=True, slots=True)
class WorkerStreamError:
    """A worker's in-stream error as the client will see it: message bounded, internal fields gone.

    `worker_status` is the worker's integer `code` when it is an HTTP status (vLLM puts 400 or 500
    there); it is for accounting and logs, never sent to the client.
    """

    message: str
    type: str
    param: str | None
    worker_status: int | None
    code: str = STREAM_ERROR_CODE

    @property
    def request_rejected(self) -> bool:
        """The worker blames the request (a 4xx status), not itself."""
        return self.worker_status is not None and 400 <= self.worker_status < 500

    def event(self) -> bytes:
        return b"data: " + error_body(self.message, self.type, self.code, self.param) + b"\n\n"


def _bounded(message: str) -> str:
    raw = message.encode()
    if len(raw) <= MAX_STREAM_ERROR_MESSAGE_BYTES:
        return message
    keep = MAX_STREAM_ERROR_MESSAGE_BYTES - len(_TRUNCATED.encode())
    # errors="ignore" drops a multi-byte character cut in half at the boundary.
    return raw[:keep].decode(errors="ignore") + _TRUNCATED


def worker_error_of(inner: Any) -> WorkerStreamError:
    """The error record for the value of a worker's `error` field (or its flat error object)."""
    if isinstance(inner, str):
        inner = {"message": inner}
    elif not isinstance(inner, dict):
        inner = {}
    message = inner.get("message")
    if not isinstance(message, str) or not message:
        message = _GENERIC_MESSAGE
    status = inner.get("code")
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status < 600:
        status = None
    type_ = inner.get("type")
    if type_ not in OPENAI_ERROR_TYPES:
        type_ = "invalid_request_error" if status is not None and 400 <= status < 500 else "server_error"
    param = inner.get("param")
    return WorkerStreamError(
        message=_bounded(message),
        type=type_,
        param=param[:_MAX_PARAM_CHARS] if isinstance(param, str) and param else None,
        worker_status=status,
    )


# A worker's error event the relay could not read: the client could not have read it either.
UNREADABLE_ERROR = WorkerStreamError(_UNREADABLE_MESSAGE, "server_error", None, None)


class Relay(Protocol):
    """What a streamed response needs of its relay, whatever the API's event format: whole
    events to forward, whether the worker ended the stream (`done`), its error and usage, and
    how to end a stream that broke (`closing`). `response_id` is the Responses id, when the
    stream carried one; `content_events` the content events forwarded so far (module doc)."""

    done: bool
    error: WorkerStreamError | None
    usage: Any
    content_events: int

    @property
    def response_id(self) -> str | None: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def closing(self, message: str, code: str) -> bytes: ...


class EventRelay:
    """What every relay shares: whole events out of upstream bytes that arrive in arbitrary
    pieces, their line ends made LF. `feed` keeps the partial tail for the next chunk and hands
    the complete events to `_events`, the API's own reading of them; once the worker's error has
    been recorded (or, for APIs that end with a terminal event, `ENDS_AT_TERMINAL`, once that
    event has been seen) nothing more is forwarded."""

    ENDS_AT_TERMINAL = False
    __slots__ = ("_after_cr", "_pending", "content_events", "done", "error", "usage")

    def __init__(self) -> None:
        self._pending = b""
        self._after_cr = False  # the last chunk ended with a CR, whose LF may start the next one
        self.done = False
        self.error: WorkerStreamError | None = None
        self.usage: Any = None
        self.content_events = 0

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to forward now (whole events only); the partial tail waits for the next chunk."""
        if self.error is not None or (self.done and self.ENDS_AT_TERMINAL):
            # The worker already failed (or finished) this stream and the client has been told.
            # Whatever it sends next (more deltas, a second error, its own [DONE]) is not part of
            # an answer: a raw SSE reader would take deltas after the error as content, and a
            # second error event would break the one-error contract. The streaming response
            # stops reading here anyway.
            return b""
        if _CR in chunk or self._after_cr:  # one memchr: an LF stream pays no more
            chunk = self._lf_framed(chunk)
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > _MAX_PENDING_BYTES:
                raise MalformedStream("an oversized SSE event")
            self._pending = data
            return b""
        self._pending = data[cut + 2 :]
        return self._events(data[: cut + 2])

    def _lf_framed(self, chunk: bytes) -> bytes:
        """`chunk` with its CRLF and lone CR line ends made LF, the framing the rest of the relay
        reads and the client gets (SSE lets a line end with any of the three, mixed). A CR that
        ends a chunk becomes an LF at once, so a bare-CR stream's event is not held back for the
        next read; an LF that then starts the next chunk is the rest of that CRLF, and is dropped."""
        if self._after_cr:
            if not chunk:
                return chunk
            self._after_cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if _CR not in chunk:
            return chunk
        self._after_cr = chunk.endswith(b"\r")
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _events(self, head: bytes) -> bytes:
        """What to forward of `head`, one or more whole events (LF-framed: `_lf_framed`)."""
        raise NotImplementedError


class SseRelay(EventRelay):
    """Splits an SSE byte stream into events and rewrites the few that need it.

    - a usage chunk with `"choices": null` gets `"choices": []` (vLLM quirk; SDKs expect a list);
    - with `strip_usage`, the usage-only chunk the gateway asked for on the client's behalf is
      dropped after its usage is recorded, whatever that usage holds but null (`_usage_at`), and
      a chunk of the answer that carries usage all the same (vLLM's per-chunk usage) is
      forwarded without it;
    - a worker's error event becomes one error event in the gateway's shape, recorded in `error`;
      from then on `feed` forwards nothing;
    - `done` records whether the worker finished the stream with `[DONE]`.
    """

    __slots__ = ("strip_usage",)

    def __init__(self, strip_usage: bool) -> None:
        super().__init__()
        self.strip_usage = strip_usage

    @property
    def response_id(self) -> str | None:
        """Chat and completions streams carry no Responses id."""
        return None

    def closing(self, message: str, code: str) -> bytes:
        """What ends a stream that did not reach `[DONE]`: one error event (unless the worker's
        own was already sent, rewritten), then `[DONE]`, on which the OpenAI SDKs stop cleanly."""
        tail = error_event(message, code) if self.error is None else b""
        return tail if self.done else tail + DONE_EVENT

    def _events(self, head: bytes) -> bytes:
        # `"error"` with its quotes covers both error shapes; inside a JSON string the quotes would
        # be escaped, so only a structural key or a bare "error" value (a rare false alarm that
        # costs one parse) matches. Events before the first match are forwarded as they are.
        first = _usage_at(head)
        for marker in _MARKERS:
            at = head.find(marker)
            if at >= 0 and (first < 0 or at < first):
                first = at
        if first < 0:
            self._count(head)
            return head
        start = head.rfind(b"\n\n", 0, first) + 2 if first > 0 else 0
        if start < 2:
            return self._inspect(head)
        plain = head[:start]
        self._count(plain)
        return plain + self._inspect(head[start:])

    def _count(self, events: bytes) -> None:
        """Count the content events of `events`, whole events none of which the relay inspects."""
        n = events.count(_CHOICES)
        if n:
            n -= events.count(_FINISHED)
            if not self.content_events:  # role chunks come before a choice's first token
                n -= events.count(_EMPTY_CONTENT)
            if n > 0:
                self.content_events += n

    def _inspect(self, head: bytes) -> bytes:
        out: list[bytes] = []
        for event in head.split(b"\n\n"):
            if not event:
                continue
            payload = data_of(event)
            if payload == b"[DONE]":
                self.done = True
            elif payload is not None and (b'"usage"' in payload or b'"error"' in payload):
                rewritten = self._rewrite(payload)
                if self.error is not None:
                    # Stop at the error: events after it in this chunk are dropped like later chunks.
                    out.append(self.error.event())
                    self._pending = b""
                    break
                if rewritten is None:
                    continue
                if rewritten is not payload:
                    event = b"data: " + rewritten
            else:
                self._count(event)
            out.append(event + b"\n\n")
        return b"".join(out)

    def _rewrite(self, payload: bytes) -> bytes | None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            if b'"error"' in payload:
                # A broken payload that mentions an error: the client could not parse it either.
                self.error = UNREADABLE_ERROR
            return payload
        if not isinstance(obj, dict):
            if b'"error"' in payload:
                # A chunk is always an object; a bare `"error"` string or list is a failing worker.
                self.error = UNREADABLE_ERROR
            return payload
        inner = obj.get("error")
        if inner is not None and inner is not False:
            self.error = worker_error_of(inner)
            return payload
        if obj.get("object") == "error":
            self.error = worker_error_of(obj)
            return payload
        usage = obj.get("usage")
        if usage is None:
            # A chunk of the answer that only looked like a usage or error one (`"usage":null`, a
            # token `"error"`): counted like the others.
            self._count(payload)
            return payload
        self.usage = usage
        choices = obj.get("choices")
        if choices:
            # A chunk of the answer that carries usage too (vLLM's `continuous_usage_stats`, or
            # every stream of a vLLM run with `--enable-force-include-usage`): counted, and
            # without its usage when the client did not ask for any.
            self._count(payload)
            if not self.strip_usage:
                return payload
            del obj["usage"]
            return orjson.dumps(obj)
        if self.strip_usage:
            return None
        if "choices" in obj and choices is None:
            obj["choices"] = []
            return orjson.dumps(obj)
        return payload


def _usage_at(head: bytes) -> int:
    """Where the first `"usage":` key whose value is not null is in `head`, or -1. Any other value
    makes the chunk one to look inside: a usage chunk the client did not ask for is dropped
    whatever its usage holds (an array, a number: a faulty worker's), where a test for `{` alone
    let such a chunk through. A null one is no usage (OpenAI's API, asked for usage, puts one on
    every chunk of the answer), and passing it costs no parse."""
    at = head.find(_USAGE_KEY)
    while at >= 0:
        value = at + len(_USAGE_KEY)
        if not head.startswith(_NULL, value):
            return at
        at = head.find(_USAGE_KEY, value)
    return -1


def first_event_problem(out: bytes) -> str | None:
    """What is wrong with the first event of a stream (the relay's first output), or None.

    Every answer chunk is a `data:` event whose data is a JSON object (or `[DONE]`). A worker (or
    a proxy in front of it) that answers 200 with anything else, an HTML page say, would
    otherwise look healthy and fast. Only the first event is parsed: one check per stream, none
    per chunk. Comment lines (`: ping`) before it are allowed.
    """
    start = 0
    while start < len(out):
        end = out.find(b"\n\n", start)
        if end < 0:
            end = len(out)
        event, start = out[start:end], end + 2
        if not event or (
            event.startswith(b":") and all(line.startswith(b":") for line in event.split(b"\n"))
        ):
            continue
        payload = data_of(event)
        if payload is None:
            return "its first event carries no data"
        if payload == b"[DONE]":
            return None
        try:
            parsed = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return "its first event is not JSON"
        return None if isinstance(parsed, dict) else "its first event is not a JSON object"
    return None


def data_of(event: bytes) -> bytes | None:
    """The data of an event: its `data:` lines joined by newlines (SSE makes the space after the
    colon optional and allows `event:`/`id:` lines); None for an event without data."""
    if b"\n" not in event:
        if event.startswith(b"data: "):
            return event[6:]
        return event[5:] if event.startswith(b"data:") else None
    parts = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:].rstrip(b"\r")
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None
