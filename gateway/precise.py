"""Precise mode: key the workers' KV events with the normalizer's own token-chain hash.

A policy that accepts a token hasher (`set_token_hasher`) re-keys every stored block from its token
ids; keys agree with request keys only when the pool's normalizer produces token-exact keys
(`tokenizer` or `render` mode) under the same identity and block size as the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from gateway.state import GatewayState, base_model
from policies.base import RoutingPolicy
from prompt_normalizer.normalizer import Normalizer
from prompt_normalizer.types import BlockKey, KeyIdentity

log = logging.getLogger("kvgate.precise")


class NormalizerTokenHasher:
    """The `policies.kv_feed.TokenBlockHasher` of one pool, backed by its normalizer."""

    def __init__(self, normalizer: Normalizer, identity: KeyIdentity) -> None:
        self._normalizer = normalizer
        self._identity = identity

    def root(self, namespace: str, lora_name: str | None) -> int:
        identity = dataclasses.replace(self._identity, namespace=namespace, adapter=lora_name or "")
        return self._normalizer.root(identity)

    def chain(self, parent: int, token_ids: Sequence[int]) -> BlockKey:
        identity = dataclasses.replace(self._identity, block_size_tokens=len(token_ids))
        return self._normalizer.keys_for_tokens(token_ids, identity, parent=BlockKey(parent))[0]


def install_token_hasher(state: GatewayState, policy: RoutingPolicy) -> bool:
    """Give the policy a hasher for the pool that subscribes to KV events (the first such pool:
    the hasher interface carries no pool, so one identity serves every event stream)."""
    setter = getattr(policy, "set_token_hasher", None)
    pools = [p for p in state.registry.pools.values() if p.config.subscribes_kv_events]
    if setter is None or not pools:
        return False
    pool = pools[0]
    normalizer = state.normalizer(pool)
    if normalizer.config.mode == "approximate":
        log.warning(
            "pool %s subscribes to KV events but its normalizer is approximate: events ignored", pool.name
        )
        return False
    if len(pools) > 1:
        log.warning("KV events of several pools are keyed with pool %s's identity", pool.name)
    identity = state.base_identity(pool, base_model(pool))
    setter(NormalizerTokenHasher(normalizer, identity))
    return True
