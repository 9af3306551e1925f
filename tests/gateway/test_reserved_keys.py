"""Keys beginning with `kvgate:` are reserved: an API key's config hash and a sub-secret are the
same HMAC under the key-hash secret, so the hash of "kvgate:<purpose>" is that purpose's
sub-secret (the sync batches' signing key among them), readable by whoever reads the config.
Such keys are refused by `--hash-key`, never authenticated, and their hashes refused at start."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.auth import KeyRing
from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.serve import refuse_reserved_key_hashes
from policies.identity import (
    API_KEY_HASH_PREFIX,
    RESERVED_KEY_PREFIX,
    SUB_SECRET_PURPOSES,
    derive_secret,
    hash_api_key,
    reserved_key_hashes,
)

SECRET = b"r" * 40


def _raw(tenant_hash: str, admin_hash: str | None = None) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [
            {"name": "a", "api_key_hashes": [hash_api_key(SECRET, "sk-a")]},
            {"name": "b", "api_key_hashes": [tenant_hash]},
        ],
    }
    if admin_hash is not None:
        raw["admin"] = {"api_key_hash": admin_hash}
    return raw


def test_the_hash_of_a_reserved_key_is_a_sub_secret_and_is_listed() -> None:
    # Why the prefix is reserved: the two constructions meet exactly there.
    for purpose in SUB_SECRET_PURPOSES:
        hashed = hash_api_key(SECRET, RESERVED_KEY_PREFIX + purpose)
        assert hashed == API_KEY_HASH_PREFIX + derive_secret(SECRET, purpose).hex()
        assert hashed in reserved_key_hashes(SECRET)
    with pytest.raises(ValueError, match="unknown sub-secret purpose"):
        derive_secret(SECRET, "elsewhere")


@pytest.mark.parametrize("purpose", sorted(SUB_SECRET_PURPOSES))
def test_a_tenant_listing_a_reserved_keys_hash_stops_the_start(purpose: str) -> None:
    config = parse_config(_raw(hash_api_key(SECRET, RESERVED_KEY_PREFIX + purpose)))
    with pytest.raises(ConfigError) as refused:
        refuse_reserved_key_hashes(config, SECRET)
    message = str(refused.value)
    assert message.startswith("tenants[1].api_key_hashes: the hash of a reserved key")
    assert derive_secret(SECRET, purpose).hex() not in message


def test_an_admin_key_hash_of_a_reserved_key_stops_the_start() -> None:
    reserved = hash_api_key(SECRET, RESERVED_KEY_PREFIX + "sync_batches")
    config = parse_config(_raw(hash_api_key(SECRET, "sk-b"), admin_hash=reserved))
    with pytest.raises(ConfigError, match=r"^admin\.api_key_hash: the hash of a reserved key"):
        refuse_reserved_key_hashes(config, SECRET)


def test_ordinary_keys_start() -> None:
    config = parse_config(_raw(hash_api_key(SECRET, "sk-b"), admin_hash=hash_api_key(SECRET, "sk-admin")))
    refuse_reserved_key_hashes(config, SECRET)


def test_a_reserved_key_is_never_authenticated() -> None:
    # Even a ring built without the start's check (a hash listed anyway) takes no reserved key.
    key = RESERVED_KEY_PREFIX + "cache_salt"
    ring = KeyRing(parse_config(_raw(hash_api_key(SECRET, key))).tenants, SECRET)
    assert ring.lookup(f"Bearer {key}") is None
    assert ring.lookup("Bearer sk-a") is ring.tenants["a"]
