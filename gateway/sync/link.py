"""The transport a `sync.url` names: a `NatsLink` for `nats://` and `tls://`, a `RedisLink` for
`redis://` and `rediss://`, a `SentinelLink` (a `RedisLink` to the primary that Redis Sentinel
names) for `redis+sentinel://` and `rediss+sentinel://`, a `ClusterLink` (one to any node of a
Redis Cluster) for `redis+cluster://` and `rediss+cluster://`. All keep their connection up in the
background, publish without waiting, and bound what they received and have not applied yet; the
client library of the other broker is never imported."""

from __future__ import annotations

import asyncio
import functools
import os
import random
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.config.sync import SyncConfig
from gateway.sync.auth import connect_options, sentinel_credentials

# Batches received but not applied yet, at most, on either link (nats-py's own bound is 524,288
# and 128 MiB: minutes of a busy fleet's batches, each applied stale). 16 peers at a batch each
# 5 ms send 3,200 a second, so this is seconds of them; the bytes are 8 of the largest a broker
# may carry.
RECEIVED_MSGS = 8192
RECEIVED_BYTES = 64 * 1024 * 1024

# The least wait before each new connection attempt after a lost or failed one, on every link.
_RECONNECT_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


def reconnect_delay_s(attempt: int, draw: Callable[[], float] = random.random) -> float:
    """Seconds to wait before connection attempt `attempt` (0: the first after a loss): the
    capped backoff, lengthened by up to half of it at random (`draw`, in [0, 1)), so that the
    gateways that lost one broker (a restart, a failover) do not all come back at the same
    moment. Never shorter than the backoff, so its cap on attempts holds."""
    delay_s = _RECONNECT_BACKOFF_S[min(attempt, len(_RECONNECT_BACKOFF_S) - 1)]
    return delay_s + delay_s * draw() / 2


def raise_if_cancelled() -> None:
    """Raise `CancelledError` when the running task was asked to stop. A client library that
    turns a cancellation into an error of its own (a connect's timeout meeting the cancel, on
    3.11) would otherwise leave a link's loop reconnecting after it was told to stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class SyncLink(Protocol):
    """What the sync service needs of a transport."""

    urls: list[str]
    subject: str
    connects: int
    errors: int
    slow_consumer: int

    @property
    def connected(self) -> bool: ...

    @property
    def max_payload(self) -> int: ...

    async def run(self) -> None: ...

    async def publish(self, data: bytes) -> bool: ...

    async def close(self) -> None: ...


def open_link(config: SyncConfig, name: str, on_message: Callable[[bytes], Awaitable[None]]) -> SyncLink:
    """The link to `config.url`'s broker, on `<subject_prefix>.batches`, named `name` there;
    credentials and TLS read now (a ConfigError names a missing one)."""
    options = connect_options(config, os.environ)
    subject = f"{config.subject_prefix}.batches"
    if config.broker == "redis":
        from gateway.sync.redis_link import RedisLink

        token, password = options.get("token"), options.get("password")
        user = options.get("user")
        secret = token if isinstance(token, str) else password if isinstance(password, str) else None
        username = user if isinstance(user, str) else None
        # One call makes every kind of Redis link: a sentinel one takes its sentinels' credentials
        # besides, and the sentinel setting wins over the cluster one.
        link: type[RedisLink] | functools.partial[SentinelLink]
        if config.sentinel is not None:
            from gateway.sync.sentinel_link import SentinelLink

            sentinels = sentinel_credentials(config, os.environ)
            link = functools.partial(
                SentinelLink, sentinel_username=sentinels.user, sentinel_password=sentinels.password
            )
        elif config.cluster is not None:
            from gateway.sync.cluster_link import ClusterLink

            link = ClusterLink
        else:
            link = RedisLink
        return link(
            config.urls[0],
            subject,
            name,
            on_message,
            connect_timeout_s=config.connect_timeout_s,
            username=username,
            password=secret,
            tls=config.tls,
        )
    from gateway.sync.nats_link import NatsLink

    return NatsLink(
        config.urls,
        subject,
        name,
        on_message,
        connect_timeout_s=config.connect_timeout_s,
        options=options,
    )
