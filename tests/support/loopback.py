"""Serving an aiohttp app (a scripted worker, a metrics page) from the test's own event loop."""

from __future__ import annotations

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
