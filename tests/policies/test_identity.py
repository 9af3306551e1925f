"""Tenant identity (policies/identity.py): namespaces, salts, the wholly-public rule, key
identities, session scoping and API-key hashes, the rules the gateway and the simulator both call."""

from __future__ import annotations

import dataclasses
import re

import pytest

from policies.base import Isolation, RouteRequest
from policies.identity import (
    TenantDirectory,
    cache_salt_for,
    derive_secret,
    hash_api_key,
    key_identities,
    served_identity,
    session_key,
    tenant_namespace,
    wholly_public,
)
from prompt_normalizer.types import PUBLIC_NAMESPACE, BlockKey, KeyIdentity

SECRET = b"deployment-secret"


def test_api_keys_are_stored_as_keyed_hashes() -> None:
    h = hash_api_key(SECRET, "sk-abc")
    assert re.fullmatch("hmac-sha256:[0-9a-f]{64}", h) and "sk-abc" not in h
    assert h == hash_api_key(SECRET, "sk-abc")
    assert h != hash_api_key(SECRET, "sk-abd") and h != hash_api_key(b"other", "sk-abc")
    # Sub-secrets differ per purpose and from the secret itself.
    subs = {derive_secret(SECRET, p) for p in ("cache_salt", "prefix_keys")}
    assert len(subs) == 2 and SECRET not in subs


def test_tenants_get_their_own_namespace_and_a_keyed_salt() -> None:
    directory = TenantDirectory(SECRET)
    a = directory.add("a", Isolation.STRICT)
    pub = directory.add("public", Isolation.PUBLIC)
    assert (a.name, a.namespace, a.isolation) == ("a", "tenant:a", Isolation.STRICT)
    assert pub.namespace == tenant_namespace("public") != PUBLIC_NAMESPACE  # never the public one
    assert re.fullmatch("[0-9a-f]{32}", a.cache_salt)
    assert len({a.cache_salt, pub.cache_salt, directory.public_salt}) == 3
    assert directory.tenants == {"a": a, "public": pub}
    # Salts are keyed: another deployment's salts differ; the same secret gives the same salts.
    assert TenantDirectory(b"other").add("a", Isolation.STRICT).cache_salt != a.cache_salt
    assert TenantDirectory(SECRET).add("a", Isolation.PUBLIC).cache_salt == a.cache_salt
    # KV events carry salts: every salt resolves to its namespace, anything else to None.
    assert directory.namespace_of_salt(a.cache_salt) == "tenant:a"
    assert directory.namespace_of_salt(directory.public_salt) == PUBLIC_NAMESPACE
    assert directory.namespace_of_salt("0" * 32) is None and directory.namespace_of_salt(None) is None


def _route(isolation: Isolation, n_tokens: int, public: int) -> RouteRequest:
    keys = tuple(BlockKey(i) for i in range(public))
    return RouteRequest("r", "p", "t", "tenant:t", keys, n_tokens, 16, isolation, keys, public)


def test_the_wholly_public_rule() -> None:
    shared = Isolation.SHARED_PUBLIC
    assert wholly_public(_route(shared, 64, 4), 4)
    assert wholly_public(_route(shared, 60, 4), 4)  # a partial last block inside the prefix
    assert not wholly_public(_route(shared, 65, 4), 4)  # one private token after the prefix
    assert not wholly_public(_route(shared, 64, 4), 0)
    assert not wholly_public(_route(shared, 64, 3), 4)  # more than the request's public keys
    assert not wholly_public(_route(Isolation.STRICT, 64, 4), 4)
    assert wholly_public(_route(Isolation.PUBLIC, 32, 2), 2)
    # A policy applies the stricter isolation of its own file: strict there means never.
    assert not wholly_public(_route(shared, 64, 4), 4, Isolation.STRICT)
    assert wholly_public(_route(Isolation.STRICT, 64, 4), 4, Isolation.PUBLIC)


def test_the_public_salt_only_for_a_wholly_public_prompt() -> None:
    route = _route(Isolation.SHARED_PUBLIC, 64, 4)
    assert cache_salt_for(route, 4, "tenant-salt", "public-salt") == "public-salt"
    assert cache_salt_for(route, 3, "tenant-salt", "public-salt") == "tenant-salt"
    tail = dataclasses.replace(route, n_prompt_tokens=65)
    assert cache_salt_for(tail, 4, "tenant-salt", "public-salt") == "tenant-salt"
    strict = dataclasses.replace(route, isolation=Isolation.STRICT)
    assert cache_salt_for(strict, 4, "tenant-salt", "public-salt") == "tenant-salt"


@pytest.mark.parametrize("isolation", list(Isolation))
def test_own_identity_in_the_tenants_namespace_and_a_public_twin_unless_strict(isolation: Isolation) -> None:
    base = KeyIdentity(model_id="m", weights_version="w1", adapter="lora", block_size_tokens=64, epoch=3)
    tenant = TenantDirectory(SECRET).add("t", isolation)
    own, public = key_identities(base, tenant)
    # Isolation is not part of the identity: even a `public` tenant keys in its own namespace.
    assert own == dataclasses.replace(base, namespace="tenant:t")
    if isolation is Isolation.STRICT:
        assert public is None
    else:
        assert public == dataclasses.replace(own, namespace=PUBLIC_NAMESPACE)


def test_an_adapter_is_keyed_as_the_base_model_with_that_adapter() -> None:
    deployment = KeyIdentity(model_id="base", weights_version="w1", block_size_tokens=32, namespace="x")
    lora = served_identity(deployment, "base-sql", "sql-lora")
    assert (lora.model_id, lora.adapter, lora.namespace) == ("base", "sql-lora", PUBLIC_NAMESPACE)
    assert (lora.weights_version, lora.block_size_tokens) == ("w1", 32)
    other = served_identity(deployment, "alias")
    assert (other.model_id, other.adapter) == ("alias", "")
    assert served_identity(deployment, "base") == dataclasses.replace(deployment, namespace=PUBLIC_NAMESPACE)


def test_session_keys_are_scoped_by_tenant() -> None:
    directory = TenantDirectory(SECRET)
    a, b = directory.add("a", Isolation.STRICT), directory.add("b", Isolation.STRICT)
    assert session_key(a, "conv-1") == "tenant:a/conv-1"
    assert session_key(a, "conv-1") != session_key(b, "conv-1")
    assert session_key(a, "") is None and session_key(a, None) is None and session_key(a, 7) is None
