"""The Redis link to the primary that Redis Sentinel names, followed across failovers.

Every connection attempt asks the sentinels where the primary is (`sentinel.Sentinels`, each in
turn within the connect timeout), connects both of the link's connections there, and checks with
`ROLE` that the node is a master: a sentinel can name a node that has just been demoted, and pub/sub
published on a replica never reaches the primary's subscribers, so gateways on either side of a
failover would silently stop sharing. While connected, the link asks the sentinels again every
`FOLLOW_INTERVAL_S` and sends `ROLE` instead of the plain link's PING: when the sentinels name
another address, or the node says it is a replica, both connections are closed and made again at
the new primary. Between attempts (the plain link's capped backoff) it keeps asking the sentinels
every `FOLLOW_INTERVAL_S`, and tries again at once when they name a new primary. Beside the
questions, for the link's whole life, one connection listens to the sentinels' `+switch-master`
announcements (`Sentinels.watch_switches`): one naming another primary makes the link ask the
announcing sentinel at once, connected or between attempts, so a failover is followed as soon as
a sentinel announces it, and within about `FOLLOW_INTERVAL_S` when the announcement is lost (a
subscription down, sentinels that do not publish it). Sentinels that cannot be reached while the
primary answers leave the session as it is.

What the plain link bounds (the outgoing buffer, received batches, pings, the backoff) is
unchanged; resolution adds at most one connect timeout per sentinel, and at most 16 sentinels;
announcements make at most one question every `ANNOUNCED_GAP_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from redis.asyncio.connection import Connection

from gateway.config.sync import HostPort, SyncTlsConfig, parse_sentinel_url
from gateway.sync.auth import tls_context
from gateway.sync.redis_link import RedisLink
from gateway.sync.sentinel import SentinelError, SentinelNoPermission, SentinelRefused, Sentinels, Switch

FOLLOW_INTERVAL_S = 0.5
ANNOUNCED_GAP_S = 0.05

log = logging.getLogger("kvgate.sync")


class NotPrimary(Exception):
    """The node the link reached, or is on, is not the primary the sentinels name (any more)."""


class SentinelLink(RedisLink):
    """A `RedisLink` whose server is the primary the sentinels of a `redis+sentinel://` URL name."""

    _probe = ("ROLE",)

    def __init__(
        self,
        url: str,
        subject: str,
        name: str,
        on_message: Callable[[bytes], Awaitable[None]],
        *,
        connect_timeout_s: float = 2.0,
        username: str | None = None,
        password: str | None = None,
        tls: SyncTlsConfig | None = None,
        sentinel_username: str | None = None,
        sentinel_password: str | None = None,
        **bounds: int,
    ) -> None:
        super().__init__(
            url,
            subject,
            name,
            on_message,
            connect_timeout_s=connect_timeout_s,
            username=username,
            password=password,
            tls=tls,
            **bounds,
        )
        target = parse_sentinel_url(url)
        self.sentinels = Sentinels(
            target.sentinels,
            target.master,
            timeout_s=connect_timeout_s,
            username=sentinel_username,
            password=sentinel_password,
            tls=None if self._tls is None else tls_context(self._tls),  # as the primary's
        )
        self.moves = 0  # sessions ended because the sentinels named another primary
        self.announced = 0  # +switch-master announcements of another primary than the link's
        self._primary: HostPort | None = None  # the address of the last attempt
        self._news = asyncio.Event()  # an announcement came: ask now
        self._announcer: HostPort | None = None
        self._asked_s = 0.0

    async def run(self) -> None:
        """Keep a connection up, and the sentinels' announcements heard, until cancelled."""
        watch = asyncio.create_task(
            self.sentinels.watch_switches(self._on_switch), name="sync-sentinel-watch"
        )
        try:
            await super().run()
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    def _on_switch(self, switch: Switch) -> None:
        if switch.master == self._primary:
            return  # the primary the link is on, or trying
        self.announced += 1
        self._announcer = switch.sentinel
        self._news.set()

    async def _next_question(self, delay_s: float) -> None:
        """Wait `delay_s`, or less once a sentinel announced a new primary; that sentinel is then
        asked first. At most one question every ANNOUNCED_GAP_S however many announcements come."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._news.wait(), delay_s)
        await asyncio.sleep(max(0.0, self._asked_s + ANNOUNCED_GAP_S - time.monotonic()))
        self._news.clear()
        announcer, self._announcer = self._announcer, None
        if announcer is not None:
            self.sentinels.prefer(announcer)
        self._asked_s = time.monotonic()

    async def _address(self) -> HostPort:
        self._primary = await self.sentinels.master_address()
        return self._primary

    async def _check_node(self, pub: Connection) -> None:
        await pub.send_command("ROLE", check_health=False)
        self._check_reply(await pub.read_response(timeout=math.inf))

    def _check_reply(self, reply: object) -> None:
        # ROLE's reply is the only list the publishing connection gets (PUBLISH answers a number).
        if isinstance(reply, list) and reply and reply[0] != b"master":
            role = reply[0].decode(errors="replace") if isinstance(reply[0], bytes) else repr(reply[0])
            raise NotPrimary(f"the node the sentinels named is a {role}, not the master")

    def _watchers(self) -> list[Coroutine[Any, Any, None]]:
        return [self._follow()]

    async def _follow(self) -> None:
        while True:
            await self._next_question(FOLLOW_INTERVAL_S)
            try:
                address = await self.sentinels.master_address()
            except SentinelError:
                continue  # the primary still answers; the sentinels are asked again next time
            if address != self._primary:
                self.moves += 1
                log.info(
                    "sync: the sentinels name a new primary",
                    extra={"broker": f"{address.host}:{address.port}"},
                )
                raise NotPrimary("the sentinels name a new primary")

    async def _pause(self, delay_s: float) -> None:
        deadline = time.monotonic() + delay_s
        while True:
            try:
                address: HostPort | None = await self.sentinels.master_address()
            except SentinelError:
                address = None
            if address is not None and address != self._primary:
                return  # a new primary (or the first answer after none): try it now
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self._next_question(min(FOLLOW_INTERVAL_S, left))

    @property
    def primary(self) -> HostPort | None:
        """The address the sentinels named for the last connection attempt."""
        return self._primary

    def _error(self, exc: BaseException) -> None:
        if isinstance(exc, NotPrimary):
            self.errors += 1  # a failover, followed: said at info level where it was seen
            log.info("sync: reconnecting to the primary", extra={"reason": str(exc)})
            return
        if isinstance(exc, SentinelRefused) and not self._warned:
            self.errors += 1
            self._warned = True
            log.warning(
                "sync sentinels refused this gateway's credentials (sync.sentinel_auth); "
                "routing on local knowledge"
            )
            return
        if isinstance(exc, SentinelNoPermission) and not self._warned:
            self.errors += 1
            self._warned = True
            log.warning("sync: %s; routing on local knowledge", exc)
            return
        super()._error(exc)

    async def close(self) -> None:
        await super().close()
        self.sentinels.close()
