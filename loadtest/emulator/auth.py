"""`--api-key`: the emulated worker refuses `/v1` requests without `Authorization: Bearer <key>`,
as vLLM's `--api-key` does (its other routes, `/health` and `/metrics` among them, stay open)."""

from __future__ import annotations

import hmac

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

# vLLM's own answer to a request without the key.
_UNAUTHORIZED = orjson.dumps({"error": "Unauthorized"})
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_UNAUTHORIZED))]


class ApiKeyGuard:
    """Pure ASGI middleware: 401 for an `/v1` request whose bearer token is not the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            sent = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(sent, self._expected):
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(_UNAUTHORIZED)),
                ]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": _UNAUTHORIZED})
                return
        await self.app(scope, receive, send)
