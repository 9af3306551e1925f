"""Every link waits its capped backoff lengthened at random between connection attempts, so that
the gateways that lost one broker (a restart, a failover) do not all come back at one moment."""

from __future__ import annotations

import asyncio
from pathlib import Path
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

    def spy(servers: list[Server], tried: dict[str, int]) -> tuple[Server, float]:
        before = min(tried.get(server.uri.netloc, 0) for server in servers)
        server, delay_s = next_server(servers, tried)
        chosen.append((before, delay_s))
        return server, delay_s

    monkeypatch.setattr(nats_link, "next_server", spy)
    link = NatsLink([nats_broker.url], "t.batches", "me", _ignore)
    task = asyncio.create_task(link.run())
    try:
        await wait_until(lambda: link.connected)
        nats_broker.stop()
        await wait_until(lambda: len(chosen) >= 3, what="three reconnect attempts", timeout_s=20)
        nats_broker.start()  # the same port
        # nats-py marks the client connected a step before it calls back `on_reconnected`
        await wait_until(lambda: link.connects == 2, what="the reconnection counted", timeout_s=20)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
    assert [reconnects for reconnects, _ in chosen[:3]] == [0, 1, 2]
    bases = [_backoff_s(reconnects) for reconnects, _ in chosen]
    assert all(base <= wait < 1.5 * base for base, (_, wait) in zip(bases, chosen, strict=True))


def _server(port: int, reconnects: int) -> Server:
    return Server(uri=urlparse(f"nats://127.0.0.1:{port}"), reconnects=reconnects)


def test_nats_reconnects_first_to_a_server_tried_least_since_the_loss_after_the_drawn_backoff() -> None:
    # nats-py's own counts keep the failures of an earlier outage (4223, 4224) and never count
    # the server just lost (4222): they are not what decides.
    servers = [_server(4222, 0), _server(4223, 8), _server(4224, 8)]
    tried: dict[str, int] = {}
    order = [next_server(servers, tried, lambda: 0.0) for _ in range(4)]
    assert [server.uri.port for server, _ in order] == [4222, 4223, 4224, 4222]
    assert [delay_s for _, delay_s in order] == [_backoff_s(0)] * 3 + [_backoff_s(1)]
    chosen, delay_s = next_server(servers, {"127.0.0.1:4222": 1}, lambda: 0.999)
    assert chosen.uri.port == 4224 and delay_s == pytest.approx(1.4995 * _backoff_s(0))
    # Right after a loss (nothing tried yet), the shortest backoff, and each server chosen by some.
    assert {next_server(servers, {})[0].uri.port for _ in range(200)} == {4222, 4223, 4224}
    assert all(0.2 <= next_server(servers, {})[1] < 0.3 for _ in range(50))


async def test_a_nats_link_fails_over_to_a_server_that_failed_in_an_earlier_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = LocalBroker(free_port(), tmp_path / "a")
    b = LocalBroker(free_port(), tmp_path / "b")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = NatsLink([a.url, b.url], "t.batches", "me", _ignore)
    task = asyncio.create_task(link.run())
    try:
        a.start()  # b is down: nats-py counts its failures while the link connects to a
        await wait_until(lambda: link.connected)
        nc = link._nc
        assert nc is not None
        # Make b look as a server that failed many times before (an earlier outage).
        for server in nc._server_pool:
            if server.uri.port == b.port:
                server.reconnects = 8
        b.start()
        a.stop()
        await wait_until(
            lambda: link.connected and nc.connected_url is not None and nc.connected_url.port == b.port,
            what="the link on b",
            timeout_s=10,  # a few drawn backoffs; with nats-py's counts it took tens of seconds
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
        a.stop()
        b.stop()


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
