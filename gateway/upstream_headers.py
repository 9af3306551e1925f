"""What the gateway sends a pool's workers besides the request body: the pool's API key, and the
client headers the pool's `forward_headers` allows.

Workers started with an API key (vLLM's `--api-key`, SGLang's `--api-key`) want
`Authorization: Bearer <key>`; the gateway sends it on every request to them: completions,
render calls, health checks and metric scrapes. The key comes from an environment variable or a
file (a mounted Secret), is held only here, and never appears in a log line, a repr or
`/admin/status`.

A client's own headers reach a worker only when the pool names them. Hop-by-hop headers (they
describe one connection, not the request), credentials (the client's key is the gateway's
business, the worker's key is the pool's), the headers the gateway sets itself, engine-internal
headers (vLLM reads `X-data-parallel-rank` as the body field `data_parallel_rank`, which the
gateway refuses from clients: it pins the request to one engine rank, past the worker's own load
balancing; and `X-Vllm-Priority` in place of the body's `priority`, which the gateway sets to the
tenant's `engine_priority`: a client's header would choose its own place in every tenant's
queue) and proxy headers (`Forwarded`, `X-Forwarded-*`, `X-Real-IP`: a worker, or whatever
sits behind it, may trust them as a proxy's word about the client, and a client's copy would be
believed) can never be forwarded: the config is refused when it names one, saying why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

_HOP_BY_HOP = "hop-by-hop, a credential, or set by the gateway"
_ENGINE_INTERNAL = (
    "an engine-internal header: vLLM reads it as the body field data_parallel_rank, "
    "which pins a request to one engine rank and is refused from clients"
)
_ENGINE_PRIORITY = (
    "an engine-internal header: vLLM reads it in place of the body field priority, "
    "which the gateway sets to the tenant's engine_priority"
)
_PROXY = "a proxy header: a worker may trust it as a proxy's word about the client"

# Why each name can never be forwarded. RFC 9110 7.6.1 and proxies' own; credentials and cookies;
# what the gateway writes itself; an engine's internal routing; what proxies assert about a client.
_REFUSED = {
    **dict.fromkeys(
        (
            "connection",
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "proxy-authenticate",
            "proxy-authorization",
            "authorization",
            "x-api-key",
            "api-key",
            "cookie",
            "set-cookie",
            "host",
            "content-length",
            "content-type",
            "content-encoding",
            "expect",
            "x-request-id",
        ),
        _HOP_BY_HOP,
    ),
    "x-data-parallel-rank": _ENGINE_INTERNAL,
    "x-vllm-priority": _ENGINE_PRIORITY,
    "forwarded": _PROXY,
    "x-real-ip": _PROXY,
}
NEVER_FORWARDED = frozenset(_REFUSED)
# Every name under this prefix is a proxy header (`X-Forwarded-For`, `-Host`, `-Proto`, `-Port`, ...).
NEVER_FORWARDED_PREFIX = "x-forwarded-"
_TOKEN = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")

# The headers of a worker's answer the gateway keeps (`upstream.RetryHints`, lower-case): its
# retry advice, passed on with an error (`retries.forwardable`), and vLLM's `metadata` (the id,
# model, usage and per-input offsets and shapes of a binary embeddings answer, `encoding_format`
# "bytes"), passed on with a 200 that is not JSON (`passed_on`). No other answer header reaches
# the client.
ANSWER_HEADERS = (b"retry-after", b"retry-after-ms", b"metadata")
_PASSED_ON_WITH_A_BODY = frozenset({b"metadata"})


def answer_hints(headers: Mapping[str, str]) -> tuple[tuple[bytes, bytes], ...]:
    """The answer headers the gateway keeps (`ANSWER_HEADERS`) of an aiohttp answer, as bytes. A
    value that is not latin-1 (aiohttp decodes UTF-8) is dropped: a worker's malformed hint is
    no reason to fail the client's request, and the client gets no hint rather than a 500."""
    hints = []
    for name in ANSWER_HEADERS:
        value = headers.get(name.decode())
        if value is None:
            continue
        try:
            hints.append((name, value.encode("latin-1")))
        except UnicodeEncodeError:
            continue
    return tuple(hints)


def forwardable_name(name: str) -> str:
    """`name` lower-cased, if a client header of that name may be forwarded; ValueError if not."""
    lowered = name.strip().lower()
    if not _TOKEN.fullmatch(lowered):
        raise ValueError(f"{name!r} is not a header name")
    reason = _PROXY if lowered.startswith(NEVER_FORWARDED_PREFIX) else _REFUSED.get(lowered)
    if reason is not None:
        raise ValueError(f"{lowered!r} can never be forwarded ({reason})")
    return lowered


class WorkerAuth:
    """A pool's API key for its workers, ready to send; `NO_AUTH` when the pool has none. The key
    itself is not an attribute: only the two encodings of its header are kept."""

    __slots__ = ("headers", "lean_lines")

    def __init__(self, key: str | None) -> None:
        if key is None:
            self.headers: dict[str, str] = {}
            self.lean_lines = b""
            return
        value = f"Bearer {key}"
        self.headers = {"Authorization": value}
        self.lean_lines = b"Authorization: " + value.encode("latin-1") + b"\r\n"

    def __repr__(self) -> str:
        return "WorkerAuth(<key>)" if self.headers else "WorkerAuth(none)"


NO_AUTH = WorkerAuth(None)


def check_worker_key(key: str) -> str:
    """The key as it will be sent; ValueError (never quoting the key) when it cannot be a header."""
    if not key:
        raise ValueError("the worker API key is empty")
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in key):
        raise ValueError("the worker API key must be printable ASCII without spaces")
    return key


ClientHeaders = tuple[tuple[bytes, bytes], ...]


def pick(raw: Iterable[tuple[bytes, bytes]], allowed: frozenset[bytes]) -> ClientHeaders:
    """The client's headers whose (lower-case ASGI) names are in `allowed`, in their order."""
    return tuple((name, value) for name, value in raw if name in allowed)


def lean_lines(headers: ClientHeaders) -> bytes:
    """`Name: value\\r\\n` lines (the HTTP server already refused CR and LF inside values)."""
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)


def aiohttp_pairs(headers: ClientHeaders) -> Sequence[tuple[str, str]]:
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]


def worker_headers(
    request_id: str, auth: WorkerAuth, client: ClientHeaders, trace: Iterable[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """The headers the gateway sends a pool's worker for a client's request through aiohttp (a
    proxied request, after its content type; a stored response's `GET` or `cancel`, the search
    for its holder): the gateway's `request_id`, the pool's key for its workers
    (`auth`), the client headers the pool forwards (`client`, `pick`ed with the pool's names) and
    the trace context the request travels in (`trace`), for aiohttp."""
    return [("x-request-id", request_id), *auth.headers.items(), *aiohttp_pairs(client), *trace]


def passed_on(hints: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The answer headers that go to the client with a worker's 200 that is not JSON."""
    return [(name, value) for name, value in hints if name in _PASSED_ON_WITH_A_BODY]
