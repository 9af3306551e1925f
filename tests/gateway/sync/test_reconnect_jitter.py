"""Every link waits its capped backoff lengthened at random between connection attempts, so that
the gateways that lost one broker (a restart, a failover) do not all come back at one moment."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlparse

import pytest
from nats.aio.client import Server

from gateway.sync import nats_link
from gateway.sync.broker import LocalBroker
from gateway.sync.link import reconnect_delay_s
from gateway.sync.nats_link import NatsLink, next_server
from gateway.sync.redis_link import RedisLink
from tests.e2e.harness import free_port
from tests.support.wait import wait_until


def _backoff_s(attempt: int) -> float:
    return reconnect_delay_s(attempt, lambda: 0.0)


def test_the_delay_is_the_backoff_lengthened_at_random() -> None:
    for attempt in range(8):
        assert _backoff_s(attempt) == (0.2, 0.5, 1.0, 2.0, 5.0)[min(attempt, 4)]  # the cap holds
        assert reconnect_delay_s(attempt, lambda: 0.999) == pytest.approx(1.4995 * _backoff_s(attempt))
    drawn = {reconnect_delay_s(0) for _ in range(32)}
    assert len(drawn) > 1 and all(0.2 <= d < 0.3 for d in drawn)


async def _ignore(data: bytes) -> None:
    return None


async def test_a_redis_link_to_no_broker_waits_a_drawn_delay_between_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []

    async def pause(delay_s: float) -> None:
        waits.append(delay_s)
        await asyncio.sleep(0.001)

    link = RedisLink(f"redis://127.0.0.1:{free_port()}", "t.batches", "me", _ignore)  # no one there
    monkeypatch.setattr(link, "_pause", pause)
    task = asyncio.create_task(link.run())
    try:
        await wait_until(lambda: len(waits) >= 6, what="six refused attempts")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
    bases = [_backoff_s(attempt) for attempt in range(6)]
    # Each within its backoff and half again, and not all the backoff itself: a fixed table
    # would put every gateway's attempts in step.
    assert all(base <= wait < 1.5 * base for base, wait in zip(bases, waits, strict=False))
    assert any(wait > base for base, wait in zip(bases, waits, strict=False))


async def test_a_nats_link_that_lost_its_server_reconnects_after_drawn_delays(
    nats_broker: LocalBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen: list[tuple[int, float]] = []

    def spy(servers: list[Server], info: dict[str, Any]) -> tuple[Server, float]:
        server, delay_s = next_server(servers, info)
        chosen.append((server.reconnects, delay_s))
        return server, delay_s

    monkeypatch.setattr(nats_link, "next_server", spy)
    link = NatsLink([nats_broker.url], "t.batches", "me", _ignore)
    task = asyncio.create_task(link.run())
    try:
        await wait_until(lambda: link.connected)
        nats_broker.stop()
        await wait_until(lambda: len(chosen) >= 3, what="three reconnect attempts", timeout_s=20)
        nats_broker.start()  # the same port
        await wait_until(lambda: link.connected, timeout_s=20)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
    assert [reconnects for reconnects, _ in chosen[:3]] == [0, 1, 2]
    bases = [_backoff_s(reconnects) for reconnects, _ in chosen]
    assert all(base <= wait < 1.5 * base for base, (_, wait) in zip(bases, chosen, strict=True))
    assert link.connects == 2


def _server(port: int, reconnects: int) -> Server:
    return Server(uri=urlparse(f"nats://127.0.0.1:{port}"), reconnects=reconnects)


def test_nats_reconnects_first_to_a_server_tried_least_after_the_drawn_backoff() -> None:
    servers = [_server(4222, 2), _server(4223, 1), _server(4224, 1)]
    chosen, delay_s = next_server(servers, {}, lambda: 0.0)
    assert chosen.uri.port == 4223 and delay_s == _backoff_s(1)
    chosen, delay_s = next_server(servers, {}, lambda: 0.999)
    assert chosen.uri.port == 4224 and delay_s == pytest.approx(1.4995 * _backoff_s(1))
    # Right after a loss (nothing tried yet), the shortest backoff, and each server chosen by some.
    fresh = [_server(port, 0) for port in (4222, 4223, 4224)]
    assert {next_server(fresh, {})[0].uri.port for _ in range(200)} == {4222, 4223, 4224}
    assert all(0.2 <= next_server(fresh, {})[1] < 0.3 for _ in range(50))


class _SwallowingConnect:
    """A connect that turns its cancellation into an error of its own, as a client library's
    timeout meeting the cancel can on 3.11."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def __call__(self) -> None:
        self.entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectionError("connect interrupted") from None


@pytest.mark.parametrize("kind", ["redis", "nats"])
async def test_a_link_told_to_stop_stops_though_its_client_library_turned_the_cancel_into_an_error(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = f"127.0.0.1:{free_port()}"
    connect = _SwallowingConnect()
    link: RedisLink | NatsLink
    if kind == "redis":
        link = RedisLink(f"redis://{address}", "t.batches", "me", _ignore)
        monkeypatch.setattr(link, "_session", connect)
    else:
        link = NatsLink([f"nats://{address}"], "t.batches", "me", _ignore)
        monkeypatch.setattr(link, "_connect", connect)

    async def pause(delay_s: float) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(link, "_pause", pause)
    task = asyncio.create_task(link.run())
    try:
        await wait_until(connect.entered.is_set, what="the link in its connect")
        task.cancel()
        await wait_until(task.done, what="the link's loop ended", timeout_s=5)
        assert task.cancelled()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
