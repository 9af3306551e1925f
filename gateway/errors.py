"""OpenAI-shaped error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson
from starlette.types import Receive, Scope, Send

from gateway.rate_buckets import Standing


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error the gateway answers itself, with the status the OpenAI SDKs map to an exception.
    A quota's 429 carries the tenant's rate limits as OpenAI's `x-ratelimit-*` in `headers`, and
    the buckets they were written from in `standings`, from which Anthropic's envelope writes its
    own headers in their place (`anthropic.error_response`)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    standings: tuple[Standing, ...] = ()

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


# OpenAI's error types by status; any other 4xx reads as a bad request.
_TYPE_BY_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}
MAX_WORKER_MESSAGE_CHARS = 2000


def error_type(status: int) -> str:
    """OpenAI's error `type` for `status`: by `_TYPE_BY_STATUS`, else `invalid_request_error` for
    a 4xx and `server_error` for a 5xx."""
    return _TYPE_BY_STATUS.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


def normalize_worker_error(status: int, body: bytes) -> bytes:
    """A worker's error body in the gateway's own OpenAI shape.

    vLLM answers `{"error": {..., "type": "BadRequestError", "code": 400}}` (older versions put the
    fields at the top level with `"object": "error"`); clients should see one shape whoever
    refused the request. The worker's message and `param` are kept; `type` follows the status;
    `code` stays only when it is a string (an integer code repeats the status).
    """
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else None
    if not isinstance(inner, dict):
        inner = {}
    message = inner.get("message")
    if not isinstance(message, str) or not message:
        message = f"the worker refused the request (HTTP {status})"
    code = inner.get("code")
    param = inner.get("param")
    return error_body(
        message[:MAX_WORKER_MESSAGE_CHARS],
        error_type(status),
        code if isinstance(code, str) and code else None,
        param if isinstance(param, str) and param else None,
    )


# What a client reads in place of a salt the gateway sent, when a worker's error quotes the request
# (vLLM's validation errors quote the whole body: docs/gateway.md, "Errors").
SALT_PLACEHOLDER = b"[salt withheld]"
# The shortest head or tail of a salt that is withheld: a quote cut short keeps one (pydantic's
# `input_value=` shows a value's first 25 and last 24 characters; the gateway's own bounds on a
# worker's message cut it too). A shorter one would match ordinary text by chance, and tells
# little of a salt of 32 hex characters.
MIN_SALT_RUN = 8


def withhold_salts(text: bytes, salts: Iterable[str]) -> bytes:
    """`text` with each of `salts` replaced by `SALT_PLACEHOLDER` wherever it appears whole, and
    wherever at least `MIN_SALT_RUN` of its first or last characters do (the rest of it cut
    off); pieces that meet become one. For the error path only: `text` is searched three times
    for each salt."""
    raws = [raw for raw in (salt.encode() for salt in salts) if raw]
    for raw in raws:
        text = text.replace(raw, SALT_PLACEHOLDER)
    spans: list[tuple[int, int]] = []
    for raw in raws:
        if len(raw) <= MIN_SALT_RUN:
            continue
        head, tail = raw[:MIN_SALT_RUN], raw[-MIN_SALT_RUN:]
        at = text.find(head)
        while at >= 0:
            end, i = at + MIN_SALT_RUN, MIN_SALT_RUN
            while end < len(text) and i < len(raw) and text[end] == raw[i]:
                end, i = end + 1, i + 1
            spans.append((at, end))
            at = text.find(head, end)
        at = text.find(tail)
        while at >= 0:
            start, i = at, len(raw) - MIN_SALT_RUN
            while start > 0 and i > 0 and text[start - 1] == raw[i - 1]:
                start, i = start - 1, i - 1
            spans.append((start, at + MIN_SALT_RUN))
            at = text.find(tail, at + MIN_SALT_RUN)
    if not spans:
        return text
    spans.sort()
    out = bytearray()
    kept = 0
    start, end = spans[0]
    for span_start, span_end in spans[1:]:
        if span_start <= end:
            end = max(end, span_end)
            continue
        out += text[kept:start] + SALT_PLACEHOLDER
        kept, start, end = end, span_start, span_end
    out += text[kept:start] + SALT_PLACEHOLDER + text[end:]
    return bytes(out)


# The most of a client's string (a model id, a path, an id) an error quotes back: the string is
# anything up to the body or URL limits, and its error would otherwise be as large.
ECHOED_CHARS = 256


def echoed(text: str, limit: int = ECHOED_CHARS) -> str:
    """`text` as an error quotes it: whole up to `limit` characters, else its start and `...`."""
    return text if len(text) <= limit else text[:limit] + "..."


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_request", param)


# The code of the 503 that a worker's 529 (overloaded) becomes (`failure.worker_status`); on the
# Anthropic routes it keeps its 529 (`anthropic.error_response`).
WORKER_OVERLOADED = "worker_overloaded"


def upstream_error(status: int, message: str) -> ApiError:
    code = {502: "bad_gateway", 503: "no_worker_available", 504: "upstream_timeout"}.get(
        status, "server_error"
    )
    headers = {"retry-after": "1"} if status == 503 else {}
    return ApiError(status, message, "server_error", code, None, headers)


class RawResponse:
    """A complete response sent as two raw ASGI messages (no header-object layers on the hot path)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes | bytearray, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.body = body
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


def error_response(err: ApiError, request_id: str) -> RawResponse:
    headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    return RawResponse(err.status, err.body(), headers)
