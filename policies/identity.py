"""Tenant identity: the rules the gateway and the simulator both apply, written once.

- **Namespaces.** A tenant's keys live in `tenant:<name>`. Tenant names match `[A-Za-z0-9_.:-]+`
  (the gateway's config checks it), so a tenant namespace never equals `PUBLIC_NAMESPACE`.
- **Salts.** Every request carries a `cache_salt` that the worker mixes into its block hashes: a
  keyed hash of the tenant's namespace (`TenantDirectory.salt_of`), so one tenant can never hit,
  or time, KV that another tenant's prompts created. Only a wholly public prompt (below) carries
  the salt of the public namespace.
- **The wholly-public rule.** vLLM's salt enters block 0's hash and so covers the whole chain: a
  request shares worker KV across tenants only when its tenant is not strict and the promoted
  public blocks it was routed on cover every prompt token. One private token after them means the
  tenant's own salt.
- **Key identities.** A tenant's own identity is the served model's identity in the tenant's
  namespace, whatever its isolation (its worker KV carries its own salt, and its KV events resolve
  to that namespace); a non-strict tenant also gets the public twin
  (`prompt_normalizer.keys.public_identity_of`) for its immutable blocks. An adapter's requests
  run on the base model's weights and are keyed as (base model, adapter), which is also what a KV
  event's `lora_name` resolves to.
- **Session keys** (OpenAI's `prompt_cache_key`) are scoped by namespace, so two tenants' equal
  keys never meet.
- **API keys** are stored only as keyed hashes (`hash_api_key`); every other use of the
  deployment secret goes through a sub-secret of its own (`derive_secret`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from dataclasses import dataclass

from policies.base import Isolation, RouteRequest
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.types import PUBLIC_NAMESPACE, KeyIdentity

API_KEY_HASH_PREFIX = "hmac-sha256:"
TENANT_NAMESPACE_PREFIX = "tenant:"
_SALT_HEX_CHARS = 32


def hash_api_key(secret: bytes, api_key: str) -> str:
    """The form an API key takes in the gateway's config file (the plain key is never stored)."""
    return API_KEY_HASH_PREFIX + hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


# An API key's hash and a sub-secret are the same HMAC under the key-hash secret, so the hash of
# the API key "kvgate:<purpose>" would be that purpose's sub-secret, readable by anyone who reads
# the config holding it. Keys that begin with the prefix are reserved: `--hash-key` refuses them,
# a client presenting one is not authenticated, and their hashes are refused in a config.
RESERVED_KEY_PREFIX = "kvgate:"
SUB_SECRET_PURPOSES = frozenset(("prefix_keys", "response_ids", "cache_salt", "sync_batches"))


def derive_secret(secret: bytes, purpose: str) -> bytes:
    """A sub-secret for one purpose (one of `SUB_SECRET_PURPOSES`), so the key-hash secret itself
    is never reused elsewhere."""
    if purpose not in SUB_SECRET_PURPOSES:
        raise ValueError(f"unknown sub-secret purpose {purpose!r}")
    return hmac.new(secret, (RESERVED_KEY_PREFIX + purpose).encode(), hashlib.sha256).digest()


def reserved_key_hashes(secret: bytes) -> frozenset[str]:
    """The config hashes of the reserved keys that would equal a sub-secret (`RESERVED_KEY_PREFIX`)."""
    return frozenset(hash_api_key(secret, RESERVED_KEY_PREFIX + p) for p in SUB_SECRET_PURPOSES)


def tenant_namespace(name: str) -> str:
    """The key namespace of tenant `name`."""
    return TENANT_NAMESPACE_PREFIX + name


@dataclass(frozen=True, slots=True)
class TenantIdentity:
    """Who a request belongs to, as keys and workers see it: name, namespace, isolation, salt."""

    name: str
    namespace: str
    isolation: Isolation
    cache_salt: str


class TenantDirectory:
    """The tenants of one deployment, and the salt of every namespace under its secret.

    `salt_namespaces` maps each salt back to its key namespace (a KV event carries the salt of the
    chain it stored, never the tenant); it always holds the public salt.
    """

    def __init__(self, secret: bytes) -> None:
        self._salt_key = derive_secret(secret, "cache_salt")
        self.public_salt = self.salt_of(PUBLIC_NAMESPACE)
        self.salt_namespaces: dict[str, str] = {self.public_salt: PUBLIC_NAMESPACE}
        self.tenants: dict[str, TenantIdentity] = {}

    def salt_of(self, namespace: str) -> str:
        """The `cache_salt` of `namespace`: a keyed hash, unguessable without the secret."""
        digest = hmac.new(self._salt_key, namespace.encode(), hashlib.sha256).hexdigest()
        return digest[:_SALT_HEX_CHARS]

    def add(self, name: str, isolation: Isolation) -> TenantIdentity:
        """Register tenant `name` (again: replaced) and return its identity."""
        namespace = tenant_namespace(name)
        identity = TenantIdentity(name, namespace, isolation, self.salt_of(namespace))
        self.tenants[name] = identity
        self.salt_namespaces[identity.cache_salt] = namespace
        return identity

    def namespace_of_salt(self, salt: str | None) -> str | None:
        """The namespace a KV event's `cache_salt` resolves to (None: unknown or unsalted)."""
        return self.salt_namespaces.get(salt) if salt is not None else None


def served_identity(deployment: KeyIdentity, model: str, adapter: str = "") -> KeyIdentity:
    """The public-namespace identity of served model id `model`.

    `deployment` binds everything else (weights, tokenizer, template, block size, KV dtype, epoch)
    and names the base model in `model_id`. An adapter's requests run on the base model's weights,
    so they are keyed as (base model, adapter); any other model id is keyed as itself.
    """
    return dataclasses.replace(
        deployment,
        model_id=deployment.model_id if adapter else model,
        adapter=adapter,
        namespace=PUBLIC_NAMESPACE,
    )


def key_identities(base: KeyIdentity, tenant: TenantIdentity) -> tuple[KeyIdentity, KeyIdentity | None]:
    """A tenant's own key identity for `base`, and its public twin unless the tenant is strict."""
    own = dataclasses.replace(base, namespace=tenant.namespace)
    return own, public_identity_of(own) if tenant.isolation is not Isolation.STRICT else None


def wholly_public(req: RouteRequest, shared_blocks: int, isolation: Isolation | None = None) -> bool:
    """Whether `req`, routed with `shared_blocks` promoted public blocks, carries the public salt.

    `isolation` overrides the request's own (a policy applies the stricter of the request's and its
    policy file's); see the module doc for the rule.
    """
    level = req.isolation if isolation is None else isolation
    return (
        shared_blocks > 0
        and level is not Isolation.STRICT
        and shared_blocks <= len(req.public_block_keys)
        and shared_blocks * req.block_size_tokens >= req.n_prompt_tokens
    )


def cache_salt_for(req: RouteRequest, shared_blocks: int, tenant_salt: str, public_salt: str) -> str:
    """The `cache_salt` a worker gets for `req`: the public salt only for a wholly public prompt."""
    return public_salt if wholly_public(req, shared_blocks) else tenant_salt


def session_key(tenant: TenantIdentity, key: object) -> str | None:
    """A client's session key (`prompt_cache_key`) scoped by the tenant's namespace; None if absent."""
    return f"{tenant.namespace}/{key}" if isinstance(key, str) and key else None
