"""The Redis link to any node of one Redis Cluster (`redis+cluster://h1:6379,h2:6379`).

A cluster forwards a classic PUBLISH over its bus to every node, and a SUBSCRIBE on any node hears
it, so gateways on different nodes of one cluster share as if on one server. Separate servers do
not: gateways on two of them would silently not share. So the link checks, before anything is
published, that the node it reached says `cluster_enabled:1` (`INFO cluster`); a node that does
not is refused, with the reason, once per outage, and the link stays down (`kvgate_sync_connected`
0) rather than publish where its peers may not hear.

The nodes of the URL are tried in turn: each attempt goes to the node after the one that failed
or was lost, so a node that is down costs one attempt (and the plain link's capped backoff) before
the next one is tried. Which node a gateway is on does not matter; what the plain link bounds is
unchanged, and at most 16 nodes are named. A node cut off from the others (a partition of the
cluster bus) carries a gateway's batches only to the gateways on its side, as a partitioned NATS
cluster does.
"""

from __future__ import annotations

import functools
import logging
import math

from redis.asyncio.connection import Connection

from gateway.config.sync import HostPort, parse_cluster_url
from gateway.sync.redis_link import RedisLink

log = logging.getLogger("kvgate.sync")


class NotClusterNode(Exception):
    """The node a redis+cluster:// URL names is not in cluster mode."""


class ClusterLink(RedisLink):
    """A `RedisLink` to one of the nodes of a `redis+cluster://` URL, the next one after a failure."""

    _next = 0  # how many nodes were given up on: the next attempt goes to the one after
    node: HostPort | None = None  # the node of the last attempt

    @functools.cached_property
    def seeds(self) -> list[HostPort]:
        """The nodes the URL names, in its order."""
        return list(parse_cluster_url(self.urls[0]).seeds)

    async def _address(self) -> HostPort:
        self.node = self.seeds[self._next % len(self.seeds)]
        return self.node

    async def _check_node(self, pub: Connection) -> None:
        await pub.send_command("INFO", "cluster", check_health=False)
        reply = await pub.read_response(timeout=math.inf)
        text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
        if "cluster_enabled:1" not in text.split():
            assert self.node is not None
            raise NotClusterNode(
                f"sync.url: {self.node.host}:{self.node.port} is not a Redis Cluster node (INFO "
                "cluster says no cluster_enabled:1); a redis+cluster:// URL names nodes of one "
                "cluster, and separate servers do not share pub/sub"
            )

    async def _pause(self, delay_s: float) -> None:
        self._next += 1  # the next node: this one failed, or was lost
        await super()._pause(delay_s)

    def _error(self, exc: BaseException) -> None:
        if isinstance(exc, NotClusterNode) and not self._warned:
            self.errors += 1
            self._warned = True
            log.warning(str(exc) + "; routing on local knowledge")
            return
        super()._error(exc)
