"""Precise mode: key the workers' KV events with the normalizer's own token-chain hash.

A policy that accepts a token hasher (`set_token_hasher`) re-keys every stored block from its token
ids with `Normalizer.token_hasher`; keys agree with request keys only when the pool's normalizer
produces token-exact keys (`tokenizer` or `render` mode) under the same identity and block size as
the engine. The hasher is built on the pool's deployment identity (its base model): an event
without `lora_name` comes from the base model, one with it from that adapter.
"""

from __future__ import annotations

import logging

from gateway.state import GatewayState
from policies.base import RoutingPolicy

log = logging.getLogger("kvgate.precise")


def install_token_hasher(state: GatewayState, policy: RoutingPolicy) -> bool:
    """Give the policy a hasher for the pool that subscribes to KV events (the first such pool:
    the hasher interface carries no pool, so one identity serves every event stream)."""
    installed = _install(state, policy)
    # Without a hasher the policy ignores every event: the subscriber need not decode them.
    state.routing.kv_events_used = installed
    return installed


def _install(state: GatewayState, policy: RoutingPolicy) -> bool:
    setter = getattr(policy, "set_token_hasher", None)
    pools = [p for p in state.registry.pools.values() if p.config.subscribes_kv_events]
    if setter is None or not pools:
        return False
    pool = pools[0]
    keying = state.gate.keying
    normalizer = keying.normalizer(pool)
    if normalizer.config.mode == "approximate":
        log.warning(
            "pool %s subscribes to KV events but its normalizer is approximate: events ignored", pool.name
        )
        return False
    if len(pools) > 1:
        log.warning("KV events of several pools are keyed with pool %s's identity", pool.name)
    setter(normalizer.token_hasher(keying.deployment_identity(pool)))
    return True
