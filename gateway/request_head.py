"""The request's head: the headers the hot path reads and the request's ids.

Both are known before the API key is checked or the body read, and every answer needs them: an
error before admission still echoes the client's `x-request-id`, and a route that sends nothing
upstream answers with an id of its own (`request_id_of`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from starlette.requests import Request
from starlette.types import Scope

from gateway.anthropic import bearer_of_api_key
from gateway.retries import RETRY_COUNT_HEADER, retries_taken
from gateway.routes import ApiRoute
from policies.records import record


@record
class RequestHead:
    """The request headers the hot path reads, found in one pass over the raw ASGI headers (no
    header-object layers): `Authorization`, `x-request-id`, `Content-Length` and the SDK's
    `x-stainless-retry-count` (`retries.py`); for routes that need them (`of_route`), also
    `x-api-key` (read as the key when there is no `Authorization`) and `Content-Type` (a multipart
    body's boundary). `raw` is the ASGI header list itself, from which a pool's `forward_headers`
    are picked once the pool is known. `repeated_key` is set when the request carries its key
    twice (two `Authorization` fields, or two `x-api-key`): which one names the tenant would depend
    on who reads the head (Starlette's routes take the first), so such a request is refused
    (`admission.authenticate`)."""

    authorization: str | None
    client_request_id: str | None
    content_length: int | None
    content_type: str | None = None
    retries_taken: int = 0
    raw: Sequence[tuple[bytes, bytes]] = ()
    repeated_key: bool = False

    @classmethod
    def of(cls, scope: Scope) -> RequestHead:
        authorization = length = None
        rid: bytes | None = None
        taken = 0
        repeated = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                repeated = repeated or authorization is not None
                authorization = value.decode("latin-1")
            elif name == b"x-request-id":
                rid = value if rid is None else _again(rid, value)
            elif name == b"content-length" and value.isdigit():
                length = int(value) if len(value) <= _LENGTH_DIGITS else _long_length(value)
            elif name == RETRY_COUNT_HEADER:
                taken = retries_taken(value)
        client_id = None if rid is None else _sane_id(rid)
        if repeated:
            return cls(authorization, client_id, length, None, taken, scope["headers"], True)
        return cls(authorization, client_id, length, retries_taken=taken, raw=scope["headers"])

    @classmethod
    def of_route(cls, scope: Scope, api: ApiRoute) -> RequestHead:
        """The head for `api`: `of` itself unless the route reads more headers. The loop below is
        `of`'s with two more names, kept apart so that the chat and completions routes (the hot
        path) test no more names per header than they read."""
        if not (api.api_key_header or api.multipart):
            return cls.of(scope)
        authorization = length = content_type = api_key = None
        rid: bytes | None = None
        taken = 0
        repeated = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                repeated = repeated or authorization is not None
                authorization = value.decode("latin-1")
            elif name == b"x-request-id":
                rid = value if rid is None else _again(rid, value)
            elif name == b"content-length" and value.isdigit():
                length = int(value) if len(value) <= _LENGTH_DIGITS else _long_length(value)
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"x-api-key" and api.api_key_header:
                repeated = repeated or api_key is not None
                api_key = value
            elif name == RETRY_COUNT_HEADER:
                taken = retries_taken(value)
        if api_key:
            key = bearer_of_api_key(api_key)
            # Both headers: one key sent twice is one key; two keys name two tenants, refused.
            if authorization is not None:
                scheme, _, token = authorization.partition(" ")
                same = scheme.lower() == "bearer" and token.strip() == key[7:].strip()
                repeated = repeated or not same
            authorization = key if authorization is None else authorization
        client_id = None if rid is None else _sane_id(rid)
        return cls(authorization, client_id, length, content_type, taken, scope["headers"], repeated)


@record
class RequestIds:
    """`internal` is always made here: it names the request to the worker, the policy and the
    logs, so two clients that send the same `x-request-id` can never collide. `client` is the
    client's own id (when sane), only echoed back and logged beside the internal one.
    `retries_taken` numbers the client's own tries of one call (`retries.py`), and `headers` are
    the client's raw headers (a pool may forward some, `upstream_headers.py`)."""

    internal: str
    client: str | None
    retries_taken: int = 0
    headers: Sequence[tuple[bytes, bytes]] = ()

    @property
    def reply(self) -> str:
        """The `x-request-id` of the response: the client's own id, else the internal one."""
        return self.client if self.client is not None else self.internal


# A Content-Length of more digits than this is read without `int` of the whole string: Python
# refuses to convert more than 4,300 digits, and llhttp accepts any number of leading zeros.
_LENGTH_DIGITS = 18


def _long_length(value: bytes) -> int:
    """A long run of digits as a length: its value when the leading zeros hide a small one, else
    a length past any body limit (over 18 significant digits: an exabyte)."""
    digits = value.lstrip(b"0")
    return int(digits or b"0") if len(digits) <= _LENGTH_DIGITS else 10**_LENGTH_DIGITS


class _IdSource:
    """Internal request ids: 12 random bytes each, in hex. Every answer carries one (its
    `x-request-id`, and a worker puts it into the answer's own id), so they must tell nothing:
    a counter would show other tenants' request volume and which process served them. The OS's
    random source is read 4 KiB at a time (one read per 341 ids, not one per request), and a
    forked child drops what its parent had read, so processes never hand out the same id."""

    ID_BYTES = 12
    READ_BYTES = 4092  # a multiple of ID_BYTES

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self.drop)

    def drop(self) -> None:
        self._pool, self._at = b"", 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(self.READ_BYTES), 0
        self._at = at + self.ID_BYTES
        return self._pool[at : at + self.ID_BYTES].hex()


_ids = _IdSource()


def new_request_id() -> str:
    return _ids.next()


def request_ids(head: RequestHead) -> RequestIds:
    return RequestIds(new_request_id(), head.client_request_id, head.retries_taken, head.raw)


# What `_again` keeps of two different `x-request-id` values: no id (a header value never holds
# a line feed, and `_sane_id` refuses it).
_TWO_IDS = b"\n"


def _again(seen: bytes, value: bytes) -> bytes:
    """The `x-request-id` read so far, `seen`, after another field with `value`: the same id sent
    twice is one id, but of two different ids neither is the client's. The gateway then answers
    and logs with its own id, as without one, whatever the route (Starlette's routes would take
    the first, a loop over the head the last); the request is still served, as the id only
    labels its answer and log lines."""
    return seen if value == seen else _TWO_IDS


def _sane_id(raw: bytes) -> str | None:
    if raw and len(raw) <= 128 and raw.isascii():
        rid = raw.decode("ascii")
        if rid.isprintable():
            return rid
    return None


def client_request_id(request: Request) -> str | None:
    """A sane inbound `x-request-id` (printable ASCII, at most 128 characters) read by
    `RequestHead`'s rule (`_again`), else None."""
    rid: bytes | None = None
    for name, value in request.scope["headers"]:
        if name == b"x-request-id":
            rid = value if rid is None else _again(rid, value)
    return None if rid is None else _sane_id(rid)


def request_id_of(request: Request) -> str:
    """The id to answer with on routes that send nothing upstream."""
    return client_request_id(request) or new_request_id()
