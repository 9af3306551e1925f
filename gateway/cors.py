"""Cross-origin requests from browsers (the config's `cors` block).

It wraps the whole ASGI entry point, not the Starlette fallback alone: proxied POSTs never pass
through Starlette (`app.GatewayApp`), and their answers, errors and streams included, need the
headers as much as `/v1/models` does. It exists only when `cors.allow_origins` lists some, so with
CORS off the entry point pays one attribute check.

A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) of a path the gateway
serves is answered here: 204 with the allowed methods and headers, or 403 `cors_not_allowed`
naming what was refused. It needs no API key (browsers send none with a preflight) and never
reaches a route, so it takes no tenant slot and no worker. Any other request from an allowed
origin gets `Access-Control-Allow-Origin` (and the credentials and exposed headers) on its answer
head, whatever the answer; a request from another origin is served unchanged, and its browser
withholds the answer from the page. The `Origin` value is compared with the configured set and
echoed in that one answer's head, never kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import anthropic
from gateway.config.cors import CorsConfig
from gateway.errors import ApiError, RawResponse, error_response
from gateway.request_head import new_request_id

# Request headers a preflight may name without the config listing them (the Fetch spec's
# CORS-safelisted names; `content-type` is safelisted only for form types, JSON needs it named).
_SAFELISTED = frozenset({"accept", "accept-language", "content-language", "content-type"})
# What `allow_methods: ["*"]` answers: a list, since `*` is not a wildcard with credentials.
_ALL_METHODS = b"DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"

Route = Callable[[Scope, Receive, Send], Awaitable[None]]


def _header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


class Cors:
    """The CORS layer around the gateway's entry point; `served(scope)` says whether the
    preflight's path is one the gateway answers (with any method)."""

    def __init__(self, config: CorsConfig, served: Callable[[Scope], bool]) -> None:
        self._served = served
        self._any_origin = config.allow_origins == ["*"]
        self._origins = frozenset(origin.encode() for origin in config.allow_origins)
        self._any_method = config.allow_methods == ["*"]
        self._methods = frozenset(config.allow_methods)
        self._any_header = config.allow_headers == ["*"]
        self._headers = frozenset(config.allow_headers) | _SAFELISTED
        both: list[tuple[bytes, bytes]] = []
        if config.allow_credentials:
            both.append((b"access-control-allow-credentials", b"true"))
        self._answer_headers = [*both]
        if config.expose_headers:
            exposed = ", ".join(config.expose_headers).encode()
            self._answer_headers.append((b"access-control-expose-headers", exposed))
        methods = _ALL_METHODS if self._any_method else ", ".join(config.allow_methods).encode()
        self._preflight_headers = [
            *both,
            (b"access-control-allow-methods", methods),
            (b"access-control-max-age", str(config.max_age_s).encode()),
        ]

    def _allow_origin(self, origin: bytes) -> list[tuple[bytes, bytes]]:
        if self._any_origin:
            return [(b"access-control-allow-origin", b"*")]
        # The answer depends on the request's Origin: caches must key on it.
        return [(b"access-control-allow-origin", origin), (b"vary", b"origin")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        if scope["type"] != "http":
            await route(scope, receive, send)
            return
        headers = scope["headers"]
        origin = _header(headers, b"origin")
        allowed = origin is not None and (self._any_origin or origin in self._origins)
        if origin is not None and scope["method"] == "OPTIONS":
            requested = _header(headers, b"access-control-request-method")
            if requested is not None and self._served(scope):
                answer = self._preflight(origin, allowed, requested, headers)
                if isinstance(answer, ApiError):
                    answer = _refused(answer, scope["path"])
                await answer(scope, receive, send)
                return
        if origin is None or not allowed:
            if self._any_origin:
                await route(scope, receive, send)
            else:
                # With origins listed, every answer depends on the request's Origin (an allowed
                # one would carry the headers): caches must key on it.
                await route(scope, receive, _adding(send, _VARY))
            return
        await route(scope, receive, _adding(send, [*self._allow_origin(origin), *self._answer_headers]))

    def _preflight(
        self,
        origin: bytes,
        allowed: bool,
        method: bytes,
        headers: Sequence[tuple[bytes, bytes]],
    ) -> ASGIApp | ApiError:
        """The preflight's 204, or why it is refused."""
        if not allowed:
            return _refusal("the origin is not allowed")
        if not self._any_method and method.decode("latin-1") not in self._methods:
            return _refusal("the method is not allowed")
        asked = _header(headers, b"access-control-request-headers") or b""
        names = [n.strip().lower() for n in asked.decode("latin-1").split(",") if n.strip()]
        if not self._any_header and any(n not in self._headers for n in names):
            return _refusal("a requested header is not allowed")
        answer = [*self._allow_origin(origin), *self._preflight_headers]
        if names:
            # `*` named back as the names asked for: the spec's wildcard never covers Authorization.
            granted = asked if self._any_header else ", ".join(names).encode()
            answer.append((b"access-control-allow-headers", granted))
        return _NoContent(answer)


_VARY = [(b"vary", b"origin")]


def _adding(send: Send, added: list[tuple[bytes, bytes]]) -> Send:
    """`send`, with `added` appended to the answer's head."""

    async def send_with(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *added]}
        await send(message)

    return send_with


class _NoContent:
    """A 204 head alone (no `content-length`: a 204 has no body to measure)."""

    __slots__ = ("headers",)

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": self.headers})
        await send({"type": "http.response.body", "body": b""})


def _refusal(why: str) -> ApiError:
    return ApiError(403, f"CORS preflight refused: {why}", "invalid_request_error", "cors_not_allowed")


def _refused(err: ApiError, path: str) -> RawResponse:
    """The refusal in the shape of the API the path belongs to (Anthropic's under /v1/messages)."""
    if anthropic.owns_path(path):
        return anthropic.error_response(err, new_request_id())
    return error_response(err, new_request_id())


def serves(routes: Sequence[BaseRoute], posted: Callable[[str], bool]) -> Callable[[Scope], bool]:
    """Whether a request's path is served by the gateway with some method: a proxied POST route
    (`posted`) or one of the Starlette fallback's `routes`."""

    def served(scope: Scope) -> bool:
        return posted(scope["path"]) or any(r.matches(scope)[0] is not Match.NONE for r in routes)

    return served
