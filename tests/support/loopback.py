"""Serving an aiohttp app (a scripted worker, a metrics page) from the test's own event loop."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from loadtest.ports import free_port

_BIND_TRIES = 8


async def serve_app(app: web.Application, *, handler_cancellation: bool = False) -> tuple[web.AppRunner, int]:
    """Serve `app` on a free port of 127.0.0.1; the caller cleans the runner up. With
    `handler_cancellation` a handler is cancelled when its client closes the connection.

    The port is one of this test process's share (`loadtest.ports`), bound before the site
    starts: a port the kernel picked for a bind to port 0 could be one another parallel test
    process has just picked for a gateway it is starting, which then cannot listen."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    sock = _bound_socket()
    await web.SockSite(runner, sock).start()
    port: int = sock.getsockname()[1]
    return runner, port


def _bound_socket() -> socket.socket:
    for attempt in range(_BIND_TRIES):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", free_port()))
        except OSError as exc:  # taken between its pick and this bind by another process
            sock.close()
            if exc.errno != errno.EADDRINUSE or attempt == _BIND_TRIES - 1:
                raise
            continue
        return sock
    raise AssertionError("unreachable")


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
