"""Precise mode's token hasher (gateway/precise.py): KV events key to the request keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.precise import install_token_hasher
from gateway.state import build_state
from policies.base import RouteDecision, RouteRequest, WorkerView
from policies.kv_feed import TokenBlockHasher
from prompt_normalizer.normalizer import NormalizerConfig
from prompt_normalizer.types import BlockKey
from tests.support.policies import IgnoresFeedback

SECRET = b"k"


@dataclass
class HasherSink(IgnoresFeedback):
    """A policy that only keeps the token hasher it is given."""

    name: str = "sink"
    hashers: list[TokenBlockHasher] = field(default_factory=list)

    def set_token_hasher(self, hasher: TokenBlockHasher) -> None:
        self.hashers.append(hasher)

    def select(self, req: RouteRequest, workers: list[WorkerView], now_s: float) -> RouteDecision | None:
        return None


def _config(mode: str) -> Any:
    pool = {
        "name": "p",
        "models": ["m", "m-lora"],
        "adapters": {"m-lora": "sql-lora"},
        "workers": ["http://127.0.0.1:9"],  # never contacted: the state is built, not served
        "normalizer": {"mode": mode},
        "kv_events_endpoint": "tcp://{host}:5557",
        "identity": {"weights_version": "w1", "epoch": 2},
    }
    tenant = {"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")], "isolation": "shared_public"}
    return parse_config({"pools": [pool], "tenants": [tenant], "scrape": {"enabled": False}})


def _event_keys(
    hasher: TokenBlockHasher, namespace: str, lora: str | None, tokens: list[int]
) -> list[BlockKey]:
    prev = hasher.root(namespace, lora)
    keys = []
    for start in range(0, len(tokens), 16):
        key = hasher.chain(prev, tokens[start : start + 16])
        keys.append(key)
        prev = key
    return keys


def test_events_key_as_the_base_model_unless_they_name_an_adapter() -> None:
    policy = HasherSink()
    state = build_state(_config("render"), SECRET, policy, NormalizerConfig())
    assert install_token_hasher(state, policy) and len(policy.hashers) == 1
    assert state.routing.kv_events_used
    hasher = policy.hashers[0]
    pool, tenant = state.registry.pools["p"], state.gate.keyring.tenants["t"]
    tokens = list(range(1000, 1048))
    keys = {}
    for model, lora in (("m", None), ("m-lora", "sql-lora")):
        own, public = state.gate.keying.identities(pool, model, tenant)
        expected = state.gate.keying.normalizer(pool).keys_for_tokens(tokens, own)
        assert tuple(_event_keys(hasher, tenant.namespace, lora, tokens)) == expected
        assert public is not None  # the public twin's chain too (an unsalted or public-salted event)
        public_keys = state.gate.keying.normalizer(pool).keys_for_tokens(tokens, public)
        assert tuple(_event_keys(hasher, public.namespace, lora, tokens)) == public_keys
        keys[model] = expected
    assert set(keys["m"]).isdisjoint(keys["m-lora"])


def test_an_approximate_pool_gets_no_hasher() -> None:
    policy = HasherSink()
    state = build_state(_config("approximate"), SECRET, policy, NormalizerConfig())
    assert not install_token_hasher(state, policy) and policy.hashers == []
    assert not state.routing.kv_events_used
