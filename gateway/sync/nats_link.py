"""The transport: one NATS connection (nats-py), kept up in the background.

`run` connects, subscribes to the batch subject and waits; when the connection closes or cannot be
made it tries again with a capped backoff, forever. While connected, nats-py reconnects by itself,
after the same backoff (`link.reconnect_delay_s`, lengthened at random, so that the gateways that
lost one server do not all come back at one moment), to the server of the cluster tried least since
the loss (ties at random; the first connection's attempts are nats-py's own, every second), and
buffers at most `pending_bytes` of outgoing data; `publish` reports False instead of waiting when
the link is down or that buffer is full. Received batches wait to be applied, at most
`received_msgs` of them and `received_bytes`; beyond either the client drops them, counted as
`slow_consumer`. Nothing a request does waits on this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client, Server
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from gateway.sync.auth import ConnectOptions
from gateway.sync.link import RECEIVED_BYTES, RECEIVED_MSGS, raise_if_cancelled, reconnect_delay_s

log = logging.getLogger("kvgate.sync")


def next_server(
    servers: list[Server], tried: dict[str, int], draw: Callable[[], float] = random.random
) -> tuple[Server, float]:
    """nats-py's choice of where to reconnect, and after how long: of the cluster's servers it
    may try (`servers`, never empty), one tried least since the connection was lost (`tried`, by
    address, which this counts in; nats-py's own counts keep the failures of earlier outages and
    of the first connection, so a server that failed then would wait behind the one just lost),
    ties at random, after the link's backoff for the rounds tried so far (`reconnect_delay_s`,
    `draw` lengthening it)."""
    fewest = min(tried.get(server.uri.netloc, 0) for server in servers)
    least_tried = [server for server in servers if tried.get(server.uri.netloc, 0) == fewest]
    chosen = least_tried[int(draw() * len(least_tried))]
    tried[chosen.uri.netloc] = fewest + 1
    return chosen, reconnect_delay_s(fewest, draw)


class NatsLink:
    """A self-healing publish/subscribe link on one subject."""

    def __init__(
        self,
        urls: list[str],
        subject: str,
        name: str,
        on_message: Callable[[bytes], Awaitable[None]],
        *,
        connect_timeout_s: float = 2.0,
        pending_bytes: int = 4 * 1024 * 1024,
        options: ConnectOptions | None = None,
        received_msgs: int = RECEIVED_MSGS,
        received_bytes: int = RECEIVED_BYTES,
    ) -> None:
        self.urls = urls
        self.subject = subject
        self.name = name
        self.on_message = on_message
        self.connect_timeout_s = connect_timeout_s
        self.pending_bytes = pending_bytes
        self.received_msgs = received_msgs
        self.received_bytes = received_bytes
        self.options = options or {}  # credentials and TLS (gateway.sync.auth)
        self._nc: Client | None = None
        self._closed = asyncio.Event()
        self.connects = 0
        self.errors = 0
        self.slow_consumer = 0
        self._warned = False  # one warning per outage, not one per reconnect attempt
        self._closing = False
        self._tried: dict[str, int] = {}  # attempts at each server since the connection was lost

    def _next_server(self, servers: list[Server], info: dict[str, Any]) -> tuple[Server, float]:
        return next_server(servers, self._tried)

    @property
    def connected(self) -> bool:
        nc = self._nc
        return nc is not None and nc.is_connected

    @property
    def max_payload(self) -> int:
        """The largest message the connected server takes (its INFO `max_payload`), and that
        fits the outgoing buffer (`publish` refuses more); NATS's default of 1 MiB while not
        connected."""
        nc = self._nc
        return min(nc.max_payload, self.pending_bytes) if nc is not None and nc.is_connected else 1 << 20

    async def run(self) -> None:
        """Keep a connection up until cancelled."""
        attempt = 0
        while True:
            try:
                # nats-py retries the first connection itself (max_reconnect_attempts=-1).
                await self._connect()
                attempt = 0
                await self._closed.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad URL, or a connection closed for good
                self._error(exc)
            await self._drop()
            raise_if_cancelled()
            await self._pause(reconnect_delay_s(attempt))
            attempt += 1

    async def _pause(self, delay_s: float) -> None:
        """The wait before the next connection attempt."""
        await asyncio.sleep(delay_s)

    async def _connect(self) -> None:
        self._closed.clear()

        async def on_error(exc: Exception) -> None:
            self._error(exc)

        async def on_disconnected() -> None:
            self._tried.clear()  # nats-py awaits this before its first reconnect attempt
            if not self._closing:
                log.warning("sync broker disconnected; routing on local knowledge")

        async def on_reconnected() -> None:
            self.connects += 1
            self._warned = False
            log.info("sync broker reconnected")

        async def on_closed() -> None:
            self._closed.set()

        nc = await nats.connect(
            self.urls,
            name=self.name,
            connect_timeout=self.connect_timeout_s,
            reconnect_time_wait=1,  # the first connection's attempts, which nats-py makes itself
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            reconnect_to_server_handler=self._next_server,  # a lost one's
            no_echo=True,
            ping_interval=2,
            max_outstanding_pings=2,
            pending_size=self.pending_bytes,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
            **self.options,  # token, or user and password; tls
        )
        self._nc = nc

        async def deliver(msg: Msg) -> None:
            await self.on_message(msg.data)
            await asyncio.sleep(0)  # a backlog of batches still lets requests run between them

        await nc.subscribe(
            self.subject,
            cb=deliver,
            pending_msgs_limit=self.received_msgs,
            pending_bytes_limit=self.received_bytes,
        )
        self.connects += 1
        self._warned = False
        log.info("sync broker connected", extra={"subject": self.subject})

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        if isinstance(exc, nats.errors.SlowConsumerError):
            self.slow_consumer += 1  # our subscription fell behind: the client dropped batches
            return
        if not self._warned:
            self._warned = True
            if "authorization violation" in str(exc).lower():
                log.warning(
                    "sync broker refused this gateway's credentials (sync.auth); routing on local knowledge"
                )
                return
            log.warning("sync broker unreachable; routing on local knowledge", extra={"error": repr(exc)})

    async def publish(self, data: bytes) -> bool:
        """Send one batch; False (and nothing waits) when the link is down or its buffer is full."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            return False
        if nc.pending_data_size + len(data) > self.pending_bytes:
            # Past its buffer nats-py waits for the socket to drain, with no time limit (a broker
            # that stopped reading: until pings find it stale), and swallows a cancellation then.
            return False
        try:
            await nc.publish(self.subject, data)
        except (NatsError, OSError):
            return False
        return True

    async def _drop(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 1.0)

    async def close(self) -> None:
        self._closing = True
        await self._drop()
