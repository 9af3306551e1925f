"""API key → tenant. Keys are compared as keyed hashes; the plain key is never stored or logged."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

import xxhash

from gateway.config import QuotaConfig, TenantConfig
from policies.base import Isolation
from prompt_normalizer.types import PUBLIC_NAMESPACE

HASH_PREFIX = "hmac-sha256:"
_AUTH_CACHE_MAX = 4096


def hash_api_key(secret: bytes, api_key: str) -> str:
    """The form a key takes in the config file."""
    return HASH_PREFIX + hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


def derive_secret(secret: bytes, purpose: str) -> bytes:
    """A sub-secret for one purpose, so the key-hash secret itself is never reused elsewhere."""
    return hmac.new(secret, b"kvgate:" + purpose.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """A customer namespace as the data path sees it.

    `cache_salt` is a keyed hash of the namespace, sent with every request of the tenant (except a
    prompt wholly inside a promoted public prefix), so one tenant can never hit (or time) KV that
    another tenant's prompts created.
    """

    name: str
    namespace: str
    isolation: Isolation
    quotas: QuotaConfig
    cache_salt: str


class KeyRing:
    """Maps `Authorization: Bearer <key>` to a `Tenant`. Identity never comes from the request body.

    Also owns the worker-side salts: one per tenant, and `public_salt` for requests that lie wholly
    inside a promoted public prefix. `salt_namespaces` maps each salt back to its key namespace
    (KV events carry the salt of the chain they stored).
    """

    def __init__(self, tenants: list[TenantConfig], secret: bytes) -> None:
        self._secret = secret
        salt_secret = derive_secret(secret, "cache_salt")

        def salt_of(namespace: str) -> str:
            return hmac.new(salt_secret, namespace.encode(), hashlib.sha256).hexdigest()[:32]

        self._by_hash: dict[str, Tenant] = {}
        self._cache: dict[bytes, Tenant] = {}
        self._cache_seed = int.from_bytes(os.urandom(8), "little")
        self.tenants: dict[str, Tenant] = {}
        # Tenant names match [A-Za-z0-9_.:-]+, so "tenant:<name>" never equals the public namespace.
        self.public_salt = salt_of(PUBLIC_NAMESPACE)
        self.salt_namespaces: dict[str, str] = {self.public_salt: PUBLIC_NAMESPACE}
        for cfg in tenants:
            namespace = f"tenant:{cfg.name}"
            tenant = Tenant(cfg.name, namespace, cfg.isolation, cfg.quotas, salt_of(namespace))
            self.tenants[cfg.name] = tenant
            self.salt_namespaces[tenant.cache_salt] = namespace
            for h in cfg.api_key_hashes:
                self._by_hash[h] = tenant

    def lookup(self, authorization: str | None) -> Tenant | None:
        if not authorization:
            return None
        # Known keys are remembered under a seeded 128-bit digest of the header (never the key
        # itself), so a returning client skips the HMAC. Unknown keys are never cached.
        digest = xxhash.xxh3_128_digest(authorization.encode("latin-1", "replace"), seed=self._cache_seed)
        tenant = self._cache.get(digest)
        if tenant is not None:
            return tenant
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        tenant = self._by_hash.get(hash_api_key(self._secret, key.strip()))
        if tenant is not None:
            if len(self._cache) >= _AUTH_CACHE_MAX:
                self._cache.clear()
            self._cache[digest] = tenant
        return tenant
