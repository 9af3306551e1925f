"""An ASGI request whose client leaves on cue: for tests of what a request that is gone gives
back (its queue place, its worker slots, its count as a 499)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def leaving_request(
    app: App,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    sent: list[MutableMapping[str, Any]],
) -> tuple[asyncio.Future[None], asyncio.Event]:
    """Start `app` on one request (`body` delivered whole); the client disconnects once the
    returned event is set. What the app sends is appended to `sent`. Returns the app's task and
    the event."""
    leave = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [*headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("gw", 80),
    }
    return asyncio.ensure_future(app(scope, receive, send)), leave


def leaving_chat(
    app: App, key: str, user: str, sent: list[MutableMapping[str, Any]]
) -> tuple[asyncio.Future[None], asyncio.Event]:
    """`leaving_request` on a chat request with API key `key` and `user` tag."""
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "user": user})
    headers = [(b"authorization", f"Bearer {key}".encode())]
    return leaving_request(app, "POST", "/v1/chat/completions", headers, raw, sent)
