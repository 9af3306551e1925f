"""API key → tenant. Keys are compared as keyed hashes; the plain key is never stored or logged."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from gateway.config import QuotaConfig, TenantConfig
from policies.base import Isolation

HASH_PREFIX = "hmac-sha256:"


def hash_api_key(secret: bytes, api_key: str) -> str:
    """The form a key takes in the config file."""
    return HASH_PREFIX + hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


def derive_secret(secret: bytes, purpose: str) -> bytes:
    """A sub-secret for one purpose, so the key-hash secret itself is never reused elsewhere."""
    return hmac.new(secret, b"kvgate:" + purpose.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """A customer namespace as the data path sees it.

    `cache_salt` is forwarded to workers for strict tenants: a keyed hash of the namespace, so one
    tenant can never hit (or time) KV that another tenant's prompts created.
    """

    name: str
    namespace: str
    isolation: Isolation
    quotas: QuotaConfig
    cache_salt: str


class KeyRing:
    """Maps `Authorization: Bearer <key>` to a `Tenant`. Identity never comes from the request body."""

    def __init__(self, tenants: list[TenantConfig], secret: bytes) -> None:
        self._secret = secret
        salt_secret = derive_secret(secret, "cache_salt")
        self._by_hash: dict[str, Tenant] = {}
        for cfg in tenants:
            namespace = f"tenant:{cfg.name}"
            salt = hmac.new(salt_secret, namespace.encode(), hashlib.sha256).hexdigest()[:32]
            tenant = Tenant(cfg.name, namespace, cfg.isolation, cfg.quotas, salt)
            for h in cfg.api_key_hashes:
                self._by_hash[h] = tenant

    def lookup(self, authorization: str | None) -> Tenant | None:
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._by_hash.get(hash_api_key(self._secret, key.strip()))
