"""A gateway in the test's own event loop: the real app over a real state, its lifespan entered
(health checks, scrapers, discovery run as in `kvgate serve`), and an httpx client that speaks
ASGI to it. Workers, if any, are real servers on 127.0.0.1 that the test starts."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.app import GatewayApp, build_app
from gateway.config import GatewayConfig, parse_config
from gateway.policy_watch import PolicyWatcher
from gateway.state import GatewayState, PolicySwap, build_state
from gateway.tracing import RequestTracer
from policies.base import RoutingPolicy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.support.gateway_config import SECRET
from tests.support.wait import wait_until


@dataclass
class InProcessGateway:
    """The running app, its state, and a client whose base URL is the gateway."""

    app: GatewayApp
    state: GatewayState
    client: httpx.AsyncClient


@contextlib.asynccontextmanager
async def gateway_in_process(
    config: GatewayConfig | Mapping[str, Any],
    policy: RoutingPolicy,
    *,
    secret: bytes = SECRET,
    normalizer: NormalizerConfig | None = None,
    watcher: PolicyWatcher | None = None,
    swap: PolicySwap | None = None,
    timeout_s: float = 10.0,
    workers_up: bool = True,
    tracer: RequestTracer | None = None,
) -> AsyncIterator[InProcessGateway]:
    """Build the state and app as `kvgate serve` does and run them until the block exits.

    `config` is a parsed config or the raw mapping a YAML file would hold; `watcher` and `swap`
    come from `gateway.serve.load_policy` when the test reloads a policy file; `tracer` traces
    the requests, as `tracing.enabled` would.

    With `workers_up` the block starts once every configured worker is healthy: the lifespan's
    first round of health checks misses a worker that answers if this process stops for longer
    than the check's timeout (a long garbage collection on a loaded machine), and the next round
    comes an interval later. A test whose workers are meant to be down passes False."""
    parsed = config if isinstance(config, GatewayConfig) else parse_config(dict(config))
    state = build_state(parsed, secret, policy, normalizer or NormalizerConfig())
    if swap is not None:
        swap.state = state
    if tracer is not None:
        state.routing.tracer = tracer
    app = build_app(state, watcher)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.fallback.router.lifespan_context(app.fallback),
        httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=timeout_s) as client,
    ):
        if workers_up:
            await every_worker_up(state)
        yield InProcessGateway(app, state, client)


async def every_worker_up(state: GatewayState) -> None:
    """Wait until every worker configured at start is healthy (see `gateway_in_process`)."""
    workers = [w for pool in state.registry.pools.values() for w in pool.workers.values()]
    await wait_until(lambda: all(w.healthy for w in workers), what="every worker is healthy")
