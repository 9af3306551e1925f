"""Running the app under uvicorn with kvgate's shutdown order.

First signal: readiness turns 503 at once; after `shutdown_delay_s` uvicorn stops listening; open
streams get until `deadline_s` to finish, then end with a terminal error event. A second Ctrl-C
forces the exit.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from types import FrameType

import uvicorn

from gateway.app import build_app, drain
from gateway.config import GatewayConfig
from gateway.multiproc import reuse_port_socket
from gateway.policy_watch import LoadedPolicy, PolicyWatcher
from gateway.precise import install_token_hasher
from gateway.state import GatewayState, PolicySwap, build_state
from gateway.sync import attach_after_swap

log = logging.getLogger("kvgate.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal starts a drain instead of an immediate stop."""

    def __init__(self, config: uvicorn.Config, state: GatewayState) -> None:
        super().__init__(config)
        self._state = state
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        tune_gc()
        if self.started and self.servers:
            # uvicorn's own startup line is silenced (log_level warning): say where clients go,
            # with the bound port (a configured port 0 binds a free one).
            bound = [s.getsockname() for srv in self.servers for s in (srv.sockets or [])]
            port = bound[0][1] if bound else self.config.port
            print(f"kvgate serve: listening, base URL {base_url(self.config.host, port)}", flush=True)
            log.info("listening", extra={"base_url": base_url(self.config.host, port)})

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._state.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._state.draining = True
        log.info("draining", extra={"signal": sig})
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        drain_cfg = self._state.config.drain
        delay_s = min(drain_cfg.shutdown_delay_s, drain_cfg.deadline_s)
        await asyncio.sleep(delay_s)
        self.should_exit = True
        await drain(self._state, drain_cfg.deadline_s - delay_s)


# A request allocates a few hundred short-lived objects; at CPython's default gen-0 threshold (700)
# the collector ran every few requests and, with its older generations holding every long-lived
# object of the process, cost 10-20 µs of CPU per request in `kvgate bench overhead`. Young
# garbage is still collected (every 50,000 net allocations); what startup built (config, policy,
# tables, imported modules) is frozen out of the collector's sight.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Collect less often, and never re-scan what startup built (called once it is done)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def base_url(host: str, port: int) -> str:
    """The OpenAI base URL clients use; IPv6 literals get brackets."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/v1"


def serve(
    config: GatewayConfig,
    secret: bytes,
    loaded: LoadedPolicy,
    watcher: PolicyWatcher | None = None,
    swap: PolicySwap | None = None,
    *,
    reuse_port: bool = False,
) -> int:
    state = build_state(config, secret, loaded.policy, loaded.config.normalizer)
    install_token_hasher(state, loaded.policy)
    if swap is not None:
        swap.state = state
        swap.after_swap.append(install_token_hasher)
        swap.after_swap.append(attach_after_swap)
    app = build_app(state, watcher)
    uv_config = uvicorn.Config(
        app,
        host=config.listen.host,
        port=config.listen.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=int(config.drain.deadline_s) + 5,
        timeout_keep_alive=30,
        proxy_headers=False,  # client addresses are not used; no per-request header rewriting
        server_header=False,
    )
    server = DrainingServer(uv_config, state)
    # One of `kvgate serve --processes N`: the port is shared with the others (gateway/multiproc.py).
    sockets = [reuse_port_socket(config.listen.host, config.listen.port)] if reuse_port else None
    server.run(sockets=sockets)  # uvicorn's loop factory: uvloop when installed
    return 0 if server.started else 1
