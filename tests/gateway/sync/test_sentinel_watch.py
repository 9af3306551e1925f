"""The `+switch-master` subscription (`Sentinels.watch_switches`) against a scripted sentinel on
127.0.0.1: a malformed announcement for the master is counted and skipped, not the end of the
subscription; a lost subscription is made again after the link's backoff, lengthened at random
so that gateways do not all subscribe again at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import pytest

from gateway.config.sync import HostPort
from gateway.sync import sentinel
from gateway.sync.sentinel import SWITCH_CHANNEL, Sentinels, Switch
from tests.support.wait import wait_until


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _message(payload: bytes) -> bytes:
    return b"*3\r\n" + _bulk(b"message") + _bulk(SWITCH_CHANNEL.encode()) + _bulk(payload)


@asynccontextmanager
async def _sentinel(announcements: Sequence[bytes]) -> AsyncIterator[tuple[HostPort, list[int]]]:
    """A sentinel that takes each subscription and sends it `announcements` (none: it closes the
    connection at once); yields its address and the count of connections it took."""
    connections = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            if not announcements:
                return
            await reader.readuntil(b"+switch-master\r\n")  # the SUBSCRIBE command
            writer.write(b"*3\r\n" + _bulk(b"subscribe") + _bulk(SWITCH_CHANNEL.encode()) + b":1\r\n")
            for announcement in announcements:
                writer.write(_message(announcement))
            await writer.drain()
            await reader.read()  # until the watcher leaves (its PINGs unanswered: it is short)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield HostPort("127.0.0.1", server.sockets[0].getsockname()[1]), connections
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def _watching(sentinels: Sentinels, on_switch: Callable[[Switch], None]) -> AsyncIterator[None]:
    task = asyncio.create_task(sentinels.watch_switches(on_switch))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_malformed_announcement_is_skipped_and_the_subscription_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = [b"kvgate 10.0.0.1 6379 10.0.0.2 port", b"kvgate 10.0.0.1 6379"]
    good = b"kvgate 10.0.0.1 6379 10.0.0.2 6380"
    switches: list[Switch] = []
    async with _sentinel([*bad, good]) as (address, _):
        watched = Sentinels([address], "kvgate", timeout_s=2.0)
        with caplog.at_level(logging.WARNING, logger="kvgate.sync"):
            async with _watching(watched, switches.append):
                await wait_until(lambda: switches, what="the announcement after the malformed ones")
    assert switches == [Switch(address, HostPort("10.0.0.2", 6380))]
    assert watched.subscriptions == 1 and watched.subscription_losses == 0
    assert watched.malformed_announcements == 2
    said = [r.getMessage() for r in caplog.records if "+switch-master announcement" in r.getMessage()]
    assert len(said) == 1  # said once a while, however many come


async def test_a_lost_subscription_waits_the_random_delay_before_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[int] = []

    def delay_s(attempt: int) -> float:
        attempts.append(attempt)
        return 0.001

    monkeypatch.setattr(sentinel, "reconnect_delay_s", delay_s)
    async with _sentinel([]) as (address, connections):
        watched = Sentinels([address], "kvgate", timeout_s=2.0)
        async with _watching(watched, lambda _: None):
            await wait_until(lambda: len(attempts) >= 3, what="three subscriptions lost")
    assert attempts[:3] == [0, 1, 2] and connections[0] >= 3
    assert watched.subscriptions == 0 and watched.subscription_losses >= 3
