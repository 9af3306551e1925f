"""Running the app under uvicorn with kvgate's shutdown order, client limits and metrics listener.

First signal: readiness turns 503 at once; after `shutdown_delay_s` uvicorn stops listening for
clients (the metrics listener, which serves the probes, answers until the process ends); what
is in flight gets until `deadline_s` to finish, then the gateway ends it (`app.drain`): streams
with a terminal error event, requests still queued or waiting on a worker with a 503
`gateway_shutting_down`. uvicorn's own timeout comes `LAST_RESORT_MARGIN_S` later and finds
nothing left. A second Ctrl-C forces the exit.

SIGHUP reloads the policy file (`PolicyWatcher.reload_now`, as `POST /admin/policy/reload` does),
as operators of nginx and systemd's `ExecReload=kill -HUP $MAINPID` expect. Without a policy file
it logs that there is nothing to reload. A gateway run in the foreground of a terminal (its stdin
one) takes SIGHUP as the terminal's hangup instead, and stops as on the first SIGTERM: closing the
terminal does not leave it running in the background.

Client connections are served by `GuardedHttpToolsProtocol` (gateway/http_limits.py), whose
deadlines are checked from uvicorn's own periodic tick. `GET /metrics` is served on a listener of
its own (`metrics.listen`), never on the client port.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Literal

import uvicorn
from starlette.types import ASGIApp

from gateway.app import build_app, build_metrics_app, drain
from gateway.config import DrainConfig, GatewayConfig
from gateway.config.base import ConfigError
from gateway.file_discovery import FileWorkers, WorkersFileError
from gateway.http_guard import ClientGuard, ClientLimits, GuardedServerState
from gateway.http_limits import GuardedHttpToolsProtocol
from gateway.k8s.api import KubernetesSetupError, check_access
from gateway.lifecycle import in_terminal
from gateway.policy_watch import LoadedPolicy, PolicyWatcher
from gateway.precise import install_token_hasher
from gateway.state import GatewayState, PolicySwap, build_state
from gateway.sync import attach_after_swap
from prompt_normalizer.errors import NormalizerError

log = logging.getLogger("kvgate.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal starts a drain instead of an immediate stop, which
    enforces the client limits on its tick, and which also serves `metrics_app` on `metrics_socket`."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: GatewayState,
        metrics_app: ASGIApp,
        metrics_socket: socket.socket,
        watcher: PolicyWatcher | None = None,
    ) -> None:
        super().__init__(config)
        self._state = state
        self._watcher = watcher
        self._reloads: set[asyncio.Task[None]] = set()  # SIGHUP reloads under way
        self._guard = ClientGuard(ClientLimits.of(state.config.limits), state.routing.metrics.client_refusals)
        self.server_state = GuardedServerState(self._guard)
        self._metrics_config = _uvicorn_config(metrics_app, state.config, lifespan="off")
        self._metrics_socket = metrics_socket
        # The metrics listener's own connections: not clients, so uvicorn's shutdown neither
        # waits for them nor closes them; `shutdown` does once the drain is over.
        self._metrics_state = GuardedServerState(self._guard)
        self._metrics_server: asyncio.base_events.Server | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        with self._reload_on_sighup():
            await super().serve(sockets)

    @contextlib.contextmanager
    def _reload_on_sighup(self) -> Iterator[None]:
        # As uvicorn's own signals: set from the main thread only, and given back after.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handler = self.handle_exit if in_terminal() else self.handle_reload
        previous = signal.signal(signal.SIGHUP, handler)
        try:
            yield
        finally:
            if previous is not None:
                signal.signal(signal.SIGHUP, previous)

    def handle_reload(self, sig: int, frame: FrameType | None) -> None:
        """SIGHUP: reload the policy file on the loop (the handler runs between two bytecodes of
        whatever the main thread was doing)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_reload)

    def _start_reload(self) -> None:
        task = asyncio.ensure_future(self._reload())
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _reload(self) -> None:
        if self._watcher is None:
            log.info("SIGHUP: no policy file to reload (the config names none); still serving")
            return
        path = self._watcher.status().path
        log.info("SIGHUP: reloading the policy file", extra={"path": path})
        try:
            result = await self._watcher.reload_now()
        except Exception:
            log.exception("SIGHUP: the policy reload failed; the running policy stays")
            return
        outcome = "applied" if result.swapped else "unchanged" if result.unchanged else "rejected"
        log.info(
            "SIGHUP: policy reload %s",
            outcome,
            extra={"path": path, "result": outcome, "policy": result.status.policy, "error": result.error},
        )

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        tune_gc()
        if self.started and self.servers:
            metrics_config = self._metrics_config
            metrics_config.load()
            metrics_state = self._metrics_state

            def metrics_protocol() -> asyncio.Protocol:
                return GuardedHttpToolsProtocol(metrics_config, metrics_state, {}, capped=False)

            # Not in `self.servers`, which uvicorn closes when it stops listening for clients: the
            # probes and /metrics answer through the whole drain (readiness 503), and stop with
            # the process (`shutdown`).
            self._metrics_server = metrics = await asyncio.get_running_loop().create_server(
                metrics_protocol, sock=self._metrics_socket, backlog=metrics_config.backlog
            )
            # uvicorn's own startup line is silenced (log_level warning): say where clients go,
            # with the bound port (a configured port 0 binds a free one).
            host, port = self.config.host, _port(self.servers[0])
            metrics_host, metrics_port = self._state.config.metrics.listen.host, _port(metrics)
            print(
                f"kvgate serve: listening, base URL {base_url(host, port)}, "
                f"metrics {metrics_url(metrics_host, metrics_port)}",
                flush=True,
            )
            log.info(
                "listening",
                extra={
                    "base_url": base_url(host, port),
                    "metrics_url": metrics_url(metrics_host, metrics_port),
                },
            )

    async def on_tick(self, counter: int) -> bool:
        self._guard.tick(time.monotonic())
        if counter % 10 == 0:
            self._state.routing.metrics.client_connections.set(len(self.server_state.connections))
        should_exit = await super().on_tick(counter)
        self._metrics_state.default_headers = self.server_state.default_headers  # `Date`, as uvicorn sets it
        return should_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._state.lifecycle.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._state.lifecycle.draining = True
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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self._drain_task is not None:
            self._drain_task.cancel()  # nothing was left in flight before the deadline
        metrics, self._metrics_server = self._metrics_server, None
        if metrics is not None:
            metrics.close()
            for connection in list(self._metrics_state.connections):
                connection.shutdown()


# uvicorn's own graceful-shutdown timeout, counted from when it stops listening, ends after the
# drain deadline by this much: by then the drain has ended every request (streams with an error
# event, the rest with a 503), so uvicorn cancelling what is left is a last resort for a bug.
LAST_RESORT_MARGIN_S = 2


def server_timeout_s(drain_cfg: DrainConfig) -> int:
    """uvicorn's `timeout_graceful_shutdown`: from the end of the shutdown delay (when it stops
    listening) to `LAST_RESORT_MARGIN_S` past the drain deadline; a whole number of seconds, as
    uvicorn types it."""
    delay_s = min(drain_cfg.shutdown_delay_s, drain_cfg.deadline_s)
    return math.ceil(drain_cfg.deadline_s - delay_s) + LAST_RESORT_MARGIN_S


def _port(server: asyncio.base_events.Server) -> int:
    sockets = server.sockets or ()
    return int(sockets[0].getsockname()[1]) if sockets else 0


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
    return f"http://{_host(host)}:{port}/v1"


def metrics_url(host: str, port: int) -> str:
    """Where Prometheus scrapes this process."""
    return f"http://{_host(host)}:{port}/metrics"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind(host: str, port: int, what: str, *, reuse_port: bool = False) -> socket.socket:
    """A listening-ready TCP socket on host:port (IPv6 when the host is an IPv6 literal); with
    `reuse_port`, one that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{what}: cannot listen on {_host(host)}:{port}: {exc.strerror}") from None
    return sock


def _uvicorn_config(
    app: ASGIApp, config: GatewayConfig, lifespan: Literal["on", "off"] = "on"
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.listen.host,
        port=config.listen.port,
        http=GuardedHttpToolsProtocol,
        ws="none",  # no upgrades: every connection stays under the client limits
        # Its loggers write through the root's JSON handler at the root's level
        # (`logs.setup_logging`: warning, or `log_level` when higher).
        log_config=None,
        log_level=None,
        access_log=False,
        lifespan=lifespan,
        timeout_graceful_shutdown=server_timeout_s(config.drain),
        timeout_keep_alive=max(1, round(config.limits.keepalive_timeout_s)),  # enforced by the guard
        # A client is its connection's peer (the per-address limits, the admin throttle): forwarded
        # headers, which anyone can write, are not trusted.
        proxy_headers=False,
        server_header=False,
    )


def _check_discovery(config: GatewayConfig) -> None:
    """What discovery needs and cannot wait for, checked before serving (a Kubernetes pool's API
    server and credentials, a workers file); raises with the pool named."""
    for pool in config.pools:
        try:
            if pool.kubernetes is not None:
                check_access(pool.kubernetes)
            if pool.workers_file is not None:
                FileWorkers(pool.workers_file.path, roles=pool.takes_roles).check()
        except OSError as exc:
            raise ConfigError(f"pool {pool.name!r}: workers_file: {exc.strerror}: {exc.filename}") from None
        except (KubernetesSetupError, WorkersFileError) as exc:
            raise ConfigError(f"pool {pool.name!r}: {exc}") from None


def serve(
    config: GatewayConfig,
    secret: bytes,
    loaded: LoadedPolicy,
    watcher: PolicyWatcher | None = None,
    swap: PolicySwap | None = None,
    *,
    reuse_port: bool = False,
) -> int:
    try:
        state = build_state(config, secret, loaded.policy, loaded.config.normalizer)
        _check_discovery(config)
    except (ConfigError, NormalizerError, KubernetesSetupError) as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    install_token_hasher(state, loaded.policy)
    if watcher is not None:
        watcher.export_to(state.routing.metrics)
    if swap is not None:
        swap.state = state
        swap.after_swap.append(install_token_hasher)
        swap.after_swap.append(attach_after_swap)
    app = build_app(state, watcher)
    sockets: list[socket.socket] = []
    try:
        sockets.append(bind(config.listen.host, config.listen.port, "listen", reuse_port=reuse_port))
        sockets.append(bind(config.metrics.listen.host, config.metrics.listen.port, "metrics.listen"))
        # SO_REUSEADDR lets two sockets that do not listen yet bind one port; the config refuses
        # equal ports, and this keeps one process from ever holding two listeners on one.
        if sockets[0].getsockname()[1] == sockets[1].getsockname()[1]:
            raise ConfigError(
                f"metrics.listen: port {sockets[1].getsockname()[1]} is the client port (listen.port)"
            )
    except ConfigError as exc:
        for sock in sockets:
            sock.close()
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    client_socket, metrics_socket = sockets
    server = DrainingServer(
        _uvicorn_config(app, config), state, build_metrics_app(state), metrics_socket, watcher
    )
    # With reuse_port the client port is shared with the other `kvgate serve --processes N`
    # processes (gateway/multiproc.py).
    server.run(sockets=[client_socket])  # uvicorn's loop factory: uvloop when installed
    return 0 if server.started else 1
