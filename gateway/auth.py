"""API key → tenant. Keys are compared as keyed hashes; the plain key is never stored or logged.

What a tenant is (namespace, salt, isolation) and how keys are hashed is `policies.identity`'s;
this module reads the `Authorization` header and adds what only the gateway needs: quotas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import xxhash

from gateway.config import EnginePriorityConfig, QuotaConfig, TenantConfig
from policies.identity import (
    RESERVED_KEY_PREFIX,
    TenantDirectory,
    TenantIdentity,
    derive_secret,
    hash_api_key,
)

__all__ = ["KeyRing", "Tenant", "derive_secret", "hash_api_key"]

_AUTH_CACHE_MAX = 4096
_NO_ENGINE_PRIORITY = EnginePriorityConfig()


@dataclass(frozen=True, slots=True)
class Tenant(TenantIdentity):
    """A customer as the data path sees it: its identity (`policies.identity.TenantIdentity`:
    namespace, isolation and the `cache_salt` sent with its requests), its API-key hashes, its
    quotas and its place at engines that schedule by priority."""

    quotas: QuotaConfig
    api_key_hashes: tuple[str, ...] = ()
    engine_priority: EnginePriorityConfig = _NO_ENGINE_PRIORITY


class KeyRing:
    """Maps `Authorization: Bearer <key>` to a `Tenant`. Identity never comes from the request body.

    `directory` holds every tenant's identity and the salts: `public_salt` for requests that lie
    wholly inside a promoted public prefix, `salt_namespaces` to resolve KV events' salts.
    """

    def __init__(self, tenants: list[TenantConfig], secret: bytes) -> None:
        self._secret = secret
        self.directory = TenantDirectory(secret)
        self._by_hash: dict[str, Tenant] = {}
        self._cache: dict[bytes, Tenant] = {}
        self._cache_seed = int.from_bytes(os.urandom(8), "little")
        self.tenants: dict[str, Tenant] = {}
        for cfg in tenants:
            identity = self.directory.add(cfg.name, cfg.isolation)
            tenant = Tenant(
                identity.name,
                identity.namespace,
                identity.isolation,
                identity.cache_salt,
                quotas=cfg.quotas,
                api_key_hashes=tuple(cfg.api_key_hashes),
                engine_priority=cfg.engine_priority,
            )
            self.tenants[cfg.name] = tenant
            for h in cfg.api_key_hashes:
                self._by_hash[h] = tenant

    @property
    def public_salt(self) -> str:
        return self.directory.public_salt

    @property
    def salt_namespaces(self) -> dict[str, str]:
        return self.directory.salt_namespaces

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
        key = key.strip()
        if scheme.lower() != "bearer" or not key or key.startswith(RESERVED_KEY_PREFIX):
            return None
        tenant = self._by_hash.get(hash_api_key(self._secret, key))
        if tenant is not None:
            if len(self._cache) >= _AUTH_CACHE_MAX:
                self._cache.clear()
            self._cache[digest] = tenant
        return tenant
