"""The two upstream transports a gateway test can run its requests through."""

from __future__ import annotations

from gateway.state import GatewayState

TRANSPORTS = ["lean", "aiohttp"]


def through(state: GatewayState, transport: str) -> None:
    """Send the gateway's requests through `transport`: the lean client (http:// workers, the
    default) or aiohttp (what https workers use)."""
    if transport == "aiohttp":
        for pool in state.registry.pools.values():
            for worker in pool.workers.values():
                worker.direct = None
