"""A gateway in process in front of one worker that gives every request the same answer: for the
tests of how a worker's 200 is read (its content type, a JSON array, its head's size), on either
upstream transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping

from aiohttp import web

from tests.gateway.routes_rig import SECRET, Recording, config
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_app
from tests.support.transports import through
from tests.support.wait import wait_until


@contextlib.asynccontextmanager
async def answering(paths: Iterable[str], body: bytes, headers: Mapping[str, str]) -> AsyncIterator[str]:
    """A worker that answers every POST of `paths` with `body` and `headers` (its health check
    too, so it is routable); its URL."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def reply(_: web.Request) -> web.Response:
        return web.Response(body=body, headers=headers)

    app = web.Application()
    app.router.add_get("/health", health)
    for path in paths:
        app.router.add_post(path, reply)
    runner, port = await serve_app(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(url: str, transport: str) -> AsyncIterator[tuple[InProcessGateway, Recording]]:
    """The gateway in front of the worker at `url`, once that worker is healthy, reading its
    answers through `transport`; with the policy that records what it was told."""
    policy = Recording()
    async with gateway_in_process(config([url]), policy, secret=SECRET) as gw:
        pool = gw.state.registry.pools["p"]
        await wait_until(lambda: all(w.healthy for w in pool.workers.values()))
        through(gw.state, transport)
        yield gw, policy
