"""Serving an aiohttp app (a scripted worker, a metrics page) from the test's own event loop."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web


async def serve_app(app: web.Application, *, handler_cancellation: bool = False) -> tuple[web.AppRunner, int]:
    """Serve `app` on a port the OS picks on 127.0.0.1; the caller cleans the runner up. With
    `handler_cancellation` a handler is cancelled when its client closes the connection."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port: int = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def healthy(_: web.Request) -> web.Response:
    """A worker's `GET /health`: 200 ok."""
    return web.Response(text="ok")


async def serve_health_only() -> tuple[web.AppRunner, int]:
    """A worker that answers `GET /health` and nothing else (the caller cleans its runner up)."""
    app = web.Application()
    app.router.add_get("/health", healthy)
    return await serve_app(app)


async def serve_worker(stack: contextlib.AsyncExitStack, posts: Mapping[str, Handler]) -> str:
    """A scripted worker answering `GET /health` and the POST routes `posts` (path -> handler),
    cleaned up with `stack`: its base URL."""
    app = web.Application()
    app.router.add_get("/health", healthy)
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    return await serve_in(stack, app)


async def serve_in(stack: contextlib.AsyncExitStack, app: web.Application) -> str:
    """`serve_app`, cleaned up with `stack`: the app's base URL."""
    runner, port = await serve_app(app)
    stack.push_async_callback(runner.cleanup)
    return f"http://127.0.0.1:{port}"
