"""An ASGI chat request whose client leaves on cue: for tests of what a request that is gone
gives back (its queue place, its worker slots, its count as a 499)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def leaving_chat(
    app: App, key: str, user: str, sent: list[MutableMapping[str, Any]]
) -> tuple[asyncio.Future[None], asyncio.Event]:
    """Start `app` on a chat request with API key `key` and `user` tag; the client disconnects
    once the returned event is set. What the app sends is appended to `sent`. Returns the app's
    task and the event."""
    leave = asyncio.Event()
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "user": user})
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-length", str(len(raw)).encode()),
        ],
        "query_string": b"",
    }
    return asyncio.ensure_future(app(scope, receive, send)), leave
