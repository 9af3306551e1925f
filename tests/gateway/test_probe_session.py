"""The gateway's own checks of its workers (health, model cards, scrapes, canaries) go through a
session of their own (`transport.make_probe_session`): client traffic holding every connection of
the shared session to a worker cannot make the worker's checks time out and take it down."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from gateway.auth import hash_api_key
from policies import make_policy
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.wait import wait_until

SECRET = b"probe-session"


@dataclass
class Worker:
    """Counts `/health`; answers `GET /stream/{i}` with a stream's head and holds it open."""

    held: list[str] = field(default_factory=list)
    health_checks: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/stream/{i}", self._hold)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(text="ok")

    async def _hold(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {}\n\n")
        self.held.append(request.path)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_health_checks_are_not_starved_by_the_shared_pool() -> None:
    worker = Worker()
    runner, port = await serve_app(worker.app(), handler_cancellation=True)
    url = f"http://127.0.0.1:{port}"
    health = {"interval_s": 0.05, "timeout_s": 0.5, "failures_to_down": 1}
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": [url], "health": health}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "scrape": {"enabled": False},
        "upstream": {"max_connections_per_worker": 4},
    }
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            session = gw.state.transport.upstream()
            # Every connection the shared session may open to the worker, held open by streams.
            held = [await session.get(f"{url}/stream/{i}") for i in range(4)]
            assert len(worker.held) == 4
            pool_worker = next(iter(gw.state.registry.pools["p"].workers.values()))
            checks = worker.health_checks
            down: list[bool] = []

            def five_more_checks() -> bool:
                down.append(not pool_worker.healthy)
                return worker.health_checks >= checks + 5

            await wait_until(five_more_checks, what="five more health checks")
            assert not any(down)
            for resp in held:
                resp.close()
    finally:
        await runner.cleanup()


async def test_checks_read_answer_heads_within_the_client_traffic_bounds() -> None:
    # A header line past aiohttp's 8,190-byte default (a proxy's note), well within the gateway's
    # own bound: the worker's checks pass, as its client traffic does.
    checks: list[int] = []

    async def health(_: web.Request) -> web.Response:
        checks.append(1)
        return web.Response(text="ok", headers={"x-proxy-note": "a" * 9000})

    app = web.Application()
    app.router.add_get("/health", health)
    runner, port = await serve_app(app)
    health_cfg = {"interval_s": 0.05, "timeout_s": 1.0, "failures_to_down": 1}
    url = f"http://127.0.0.1:{port}"
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": [url], "health": health_cfg}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "scrape": {"enabled": False},
    }
    try:
        policy = make_policy("round_robin")
        async with gateway_in_process(config, policy, secret=SECRET, workers_up=False) as gw:
            worker = next(iter(gw.state.registry.pools["p"].workers.values()))
            await wait_until(lambda: len(checks) >= 3, what="three health checks")
            await wait_until(lambda: worker.healthy, what="the worker found healthy")
            seen = len(checks)
            up: list[bool] = []

            def three_more() -> bool:
                up.append(worker.healthy)
                return len(checks) >= seen + 3

            await wait_until(three_more, what="three more health checks")
            assert all(up)
    finally:
        await runner.cleanup()
