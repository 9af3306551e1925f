"""A scripted worker's Responses store: `POST /v1/responses` answered by the test's own handler,
`GET /v1/responses/{rid}` from what it stored (404 otherwise), `/health` always up."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web


def responses_app(
    create: Callable[[web.Request], Awaitable[web.StreamResponse]], stored: dict[str, Any]
) -> web.Application:
    async def get(request: web.Request) -> web.Response:
        answer = stored.get(request.match_info["rid"])
        if answer is None:
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        return web.json_response(answer)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{rid}", get)
    return app
