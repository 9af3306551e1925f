"""Serving an aiohttp app (a scripted worker, a metrics page) from the test's own event loop."""

from __future__ import annotations

from aiohttp import web


async def serve_app(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve `app` on a port the OS picks on 127.0.0.1; the caller cleans the runner up."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port: int = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port
