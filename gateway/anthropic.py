"""Anthropic's shapes on the Messages routes: the error envelope and the API key header.

Anthropic clients send their key in `x-api-key` (and an `anthropic-version` header, which the
gateway tolerates and ignores) and expect errors as `{"type": "error", "error": {"type",
"message"}}`, with Anthropic's type names. Every error on `/v1/messages` and
`/v1/messages/count_tokens` has that shape, the gateway's own (401, 413, 429, 503, ...) and a
worker's refusal alike; the status codes and the retry headers (`retry-after`,
`x-should-retry`) are the same as on the OpenAI routes.
"""

from __future__ import annotations

import orjson

from gateway.errors import MAX_WORKER_MESSAGE_CHARS, ApiError, RawResponse

# Anthropic's error type for each status; any other 4xx is a bad request, any other 5xx an API
# error. 503 (no worker, gateway at capacity) reads as Anthropic's "overloaded".
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type name for an HTTP status."""
    found = _TYPE_BY_STATUS.get(status)
    if found is not None:
        return found
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def error_response(err: ApiError, request_id: str) -> RawResponse:
    """The gateway's own error in Anthropic's envelope, with the same status and headers."""
    rid = request_id.encode()
    headers = [(b"content-type", b"application/json"), (b"x-request-id", rid), (b"request-id", rid)]
    headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    return RawResponse(err.status, error_body(err.status, err.message), headers)


def normalize_worker_error(status: int, body: bytes) -> bytes:
    """A worker's error answer in Anthropic's envelope: its message kept (bounded), whichever
    shape it came in (Anthropic's, OpenAI's or vLLM's), the type following the status."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else None
    if not isinstance(message, str) or not message:
        message = f"the worker refused the request (HTTP {status})"
    return error_body(status, message[:MAX_WORKER_MESSAGE_CHARS])


def bearer_of_api_key(value: bytes) -> str:
    """An `x-api-key` value as the `Authorization` header the key ring reads."""
    return "Bearer " + value.decode("latin-1")
