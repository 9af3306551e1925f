"""Anthropic's shapes on the Messages routes: the error envelope, the rate-limit headers and the
API key header.

Anthropic clients send their key in `x-api-key` (and an `anthropic-version` header, which the
gateway tolerates and ignores) and expect errors as `{"type": "error", "error": {"type",
"message"}}`, with Anthropic's type names. Every error on `/v1/messages` and
`/v1/messages/count_tokens` has that shape, the gateway's own (401, 413, 429, 503, ...) and a
worker's refusal alike; the status codes and the retry headers (`retry-after`,
`x-should-retry`) are the same as on the OpenAI routes, but for a worker's 529 ("overloaded",
Anthropic's own status for it), which an Anthropic client gets as sent where an OpenAI client
gets 503 (`WORKER_OVERLOADED`). A tenant's rate limits are written as Anthropic writes them,
`anthropic-ratelimit-*` (`rate_headers`), in place of OpenAI's `x-ratelimit-*`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import orjson

from gateway.errors import MAX_WORKER_MESSAGE_CHARS, WORKER_OVERLOADED, ApiError, RawResponse
from gateway.rate_buckets import Standing

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
    529: "overloaded_error",
}
# The gateway's errors whose status is another here: a worker's 529, a 503 on the OpenAI routes
# (which know no 529), reaches an Anthropic client as the worker sent it, and its SDK raises the
# `OverloadedError` it would raise talking to Anthropic's API.
_STATUS_BY_CODE = {WORKER_OVERLOADED: 529}
_OPENAI_LIMITS = "x-ratelimit-"  # OpenAI's rate-limit headers (`rate_buckets.openai_rate_headers`)
_MAX_RESET_S = 365 * 86400.0  # the furthest reset told


def error_type(status: int) -> str:
    """Anthropic's error type name for an HTTP status."""
    found = _TYPE_BY_STATUS.get(status)
    if found is not None:
        return found
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


# The Messages API's routes: every path under it answers errors in Anthropic's envelope.
PATH = "/v1/messages"


def owns_path(path: str) -> bool:
    """Whether `path` is one of the Messages API's (its clients read no other error shape)."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def error_response(err: ApiError, request_id: str) -> RawResponse:
    """The gateway's own error in Anthropic's envelope, with the same status (a worker's 529 kept:
    `_STATUS_BY_CODE`) and headers, and the tenant's rate limits as Anthropic writes them."""
    rid = request_id.encode()
    headers = [(b"content-type", b"application/json"), (b"x-request-id", rid), (b"request-id", rid)]
    if err.standings:  # a quota's 429: its rate limits as Anthropic writes them, not OpenAI's
        headers += [
            (k.encode(), v.encode()) for k, v in err.headers.items() if not k.startswith(_OPENAI_LIMITS)
        ]
        headers += rate_headers(err.standings, time.time())
    else:
        headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    status = err.status if err.code is None else _STATUS_BY_CODE.get(err.code, err.status)
    return RawResponse(status, error_body(status, err.message), headers)


def rate_headers(standings: Iterable[Standing], wall_s: float) -> list[tuple[bytes, bytes]]:
    """Anthropic's `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` for the tenant's
    buckets at `wall_s` (Unix time): the capacity, the whole units left, and when the bucket is
    full again as an RFC 3339 UTC timestamp, to the second and rounded up (by then it is full).

    The tpm is one bucket for prompt and completion tokens together, which is what Anthropic's
    `tokens-*` headers describe (the most restrictive token limit in force); the `input-tokens-*`
    and `output-tokens-*` pair describes separate input and output buckets, which kvgate does not
    have, so they are not sent: naming the tpm twice would tell a client it may spend it twice."""
    out: list[tuple[bytes, bytes]] = []
    for s in standings:
        prefix = b"anthropic-ratelimit-" + s.unit.encode()
        # A worker's absurd usage can push a bucket's refill past what a date can say: a year at most.
        full_in_s = s.full_in_s if 0.0 <= s.full_in_s < _MAX_RESET_S else _MAX_RESET_S
        full_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(wall_s + full_in_s)))
        out += [
            (prefix + b"-limit", b"%d" % s.limit),
            (prefix + b"-remaining", b"%d" % s.remaining),
            (prefix + b"-reset", full_at.encode()),
        ]
    return out


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
