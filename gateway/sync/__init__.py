"""Replica sync: gateways sharing a worker fleet share what only each of them knows.

Each gateway process publishes its routing decisions (chain keys per tenant namespace, applied by
peers as speculative holdings), their outcomes, and its in-flight load per worker, through a NATS
or Redis/Valkey broker, and applies what its peers publish (docs/sync.md). The policy side of this
is `policies.peer_sync`; this package is the I/O: `codec` (the wire format), `publisher` (the
bounded queue and batches), `subscriber` (applying peers' batches), `link` with `nats_link` and
`redis_link` (the connection) and `service` (the lifespan-owned whole). Importing this package
alone imports neither nats-py nor redis-py, and a gateway imports only its broker's client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.state import GatewayState
    from policies.base import RoutingPolicy


def attach_after_swap(state: GatewayState, policy: RoutingPolicy) -> None:
    """A policy reload's hook: the new policy publishes through the running sync service."""
    if state.sync is not None:
        state.sync.attach(policy)
