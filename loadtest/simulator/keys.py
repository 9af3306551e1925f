"""The `RouteRequest` a policy sees for a workload request, built on the gateway's own key path.

- **Tenants, identities, salts and session keys** are `policies.identity`'s, the functions the
  gateway calls: namespace `tenant:<name>` and a per-tenant `cache_salt` keyed by the deployment
  secret (`TenantDirectory`); every tenant's own identity, a `public` tenant's included, is the
  deployment's identity in its namespace, and a non-strict tenant also gets the public twin for
  its immutable blocks (`key_identities`). A tenant's isolation is `strict`, `shared_public` or
  `public` (`KeyPath(isolation=..., tenant_isolation=...)`).
- **Chat and text prompts** go through the normalizer in `render` mode exactly as the gateway
  drives it against a worker: `prepare_render`, the emulated worker's own renderer for the body and
  each zone boundary (one token per byte), `from_render`. That yields token-exact block keys, the
  `public_block_keys` of the leading immutable blocks and `immutable_blocks`; the canonical body's
  tokens are what the engine caches.
- **Trace prompts** have no text, only chained block ids. Their keys use the normalizer's own chain
  (`prompt_normalizer.keys.chain_keys`) over the ids as little-endian u64, rooted at the keyed root
  of the tenant identity under a unit of their own (`TRACE_UNIT`, so they never meet token keys),
  one key per trace block (512-token Mooncake, 64-token kv-cache-tester blocks): that is all the
  prefix structure a trace carries, and it keeps the index small. Only blocks wholly inside the
  prompt get a route key, as with the normalizer; the ceilings also count the trace's partial last
  block. A kv-cache-tester session's system + tools blocks are its immutable zone
  (`BlockPrompt.immutable_blocks`), keyed under the public identity too (non-strict tenants);
  Mooncake prompts have none.

`cache_salt` (what the engines get) is `policies.identity.cache_salt_for`: the tenant's salt
unless the whole prompt lies inside the promoted public blocks the policy routed, then the public
salt. The engine's salt covers the whole chain, so anything else would share a tenant's private
tail. So engines share KV across tenants only for wholly public prompts; the hit ceilings count
only what that allows: every chain is keyed in its tenant's namespace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from loadtest.emulator.protocol import render_chat_body
from loadtest.workloads.ceilings import BlockChain
from loadtest.workloads.openai_body import openai_request
from loadtest.workloads.records import BlockPrompt, WorkloadRequest
from policies.base import Isolation, RouteDecision, RouteRequest
from policies.identity import TenantDirectory, TenantIdentity, cache_salt_for, key_identities, session_key
from prompt_normalizer.config import NormalizerConfig
from prompt_normalizer.keys import chain_keys
from prompt_normalizer.normalizer import Normalizer
from prompt_normalizer.render import RenderPlan
from prompt_normalizer.types import BlockKey, KeyIdentity

TRACE_UNIT = "trace-id-u64-v1"
SIM_SECRET = b"kvgate-simulator-secret"
SIM_MODEL = "sim"
_U64 = np.dtype("<u8")


@dataclass(frozen=True, slots=True)
class KeyedPrompt:
    """One request's keys and model input, computed once for the loop and the ceilings.

    `chain_keys` cover every block the source keys (a trace's partial last block too);
    `block_keys` (the policy's) only the full ones. `tokens` is the engine's input (one token per
    byte) for chat and text prompts, None for a trace prompt.
    """

    tenant: TenantIdentity
    chain_keys: tuple[BlockKey, ...]
    n_full_blocks: int
    block_size_tokens: int
    n_tokens: int
    public_block_keys: tuple[BlockKey, ...] = ()
    immutable_blocks: int = 0
    tokens: bytes | None = None

    @property
    def block_keys(self) -> tuple[BlockKey, ...]:
        return self.chain_keys[: self.n_full_blocks]

    def chain(self) -> BlockChain:
        """The request's chain for the hit ceilings (keys of its tenant's namespace)."""
        keyed = min(len(self.chain_keys) * self.block_size_tokens, self.n_tokens)
        return BlockChain(self.chain_keys, self.block_size_tokens, keyed, self.n_tokens)


def _bytes_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


class KeyPath:
    """Tenants, identities, normalizer and salts of one simulated deployment (see the module doc)."""

    def __init__(
        self,
        *,
        secret: bytes = SIM_SECRET,
        model: str = SIM_MODEL,
        text_block_tokens: int = 16,
        isolation: Isolation = Isolation.STRICT,
        tenant_isolation: Mapping[str, Isolation] | None = None,
        normalizer: NormalizerConfig | None = None,
    ) -> None:
        config = normalizer or NormalizerConfig(mode="render")
        if config.mode != "render":
            raise ValueError("the simulator keys chat prompts in render mode (token-exact keys)")
        self.model = model
        self.normalizer = Normalizer(config, secret)
        self.base = KeyIdentity(model_id=model, block_size_tokens=text_block_tokens)
        self._isolation = isolation
        self._tenant_isolation = dict(tenant_isolation or {})
        self.directory = TenantDirectory(secret)
        self.public_salt = self.directory.public_salt

    # -- tenants and identities --------------------------------------------------------------

    def tenant(self, name: str) -> TenantIdentity:
        """Tenant `name` at the isolation level the simulation gives it (namespace, salt)."""
        found = self.directory.tenants.get(name)
        if found is None:
            found = self.directory.add(name, self._tenant_isolation.get(name, self._isolation))
        return found

    def identities(
        self, tenant: TenantIdentity, block_size_tokens: int
    ) -> tuple[KeyIdentity, KeyIdentity | None]:
        """The tenant's own key identity at `block_size_tokens`, and its public twin unless the
        tenant is strict (`policies.identity.key_identities`)."""
        return key_identities(dataclasses.replace(self.base, block_size_tokens=block_size_tokens), tenant)

    def namespace_of_salt(self, salt: str | None) -> str | None:
        """What the gateway resolves a KV event's `cache_salt` to (None: unknown or unsalted)."""
        return self.directory.namespace_of_salt(salt)

    # -- keys --------------------------------------------------------------------------------

    def keyed(self, req: WorkloadRequest) -> KeyedPrompt:
        tenant = self.tenant(req.tenant)
        p = req.prompt
        if isinstance(p, BlockPrompt):
            own, public = self.identities(tenant, p.block_size_tokens)
            ids = np.asarray(p.block_ids, dtype=np.uint64).astype(_U64, copy=False)
            extras = {0: p.salt.encode()} if p.salt else None
            keys = chain_keys(ids, _U64.itemsize, self.normalizer.root(own, TRACE_UNIT), extras)
            n_full = min(len(keys), p.n_tokens // p.block_size_tokens)
            n_imm = min(p.immutable_blocks, n_full)
            public_keys: tuple[BlockKey, ...] = ()
            if public is not None and n_imm:
                root = self.normalizer.root(public, TRACE_UNIT)
                public_keys = chain_keys(ids[:n_imm], _U64.itemsize, root, extras)
            return KeyedPrompt(tenant, keys, n_full, p.block_size_tokens, p.n_tokens, public_keys, n_imm)
        own, public = self.identities(tenant, self.base.block_size_tokens)
        request = openai_request(req, self.model)
        is_chat = request.path.endswith("chat/completions")
        plan = self.normalizer.prepare_render("chat" if is_chat else "completions", request.body)
        tokens = _render(plan)
        bounds = [None if b is None else _bytes_of(_render_body(plan, b)) for b in plan.boundary_bodies]
        cp = self.normalizer.from_render(plan, _bytes_of(tokens), own, public, boundary_token_ids=bounds)
        return KeyedPrompt(
            tenant,
            cp.block_keys,
            len(cp.block_keys),
            cp.block_size_tokens,
            cp.n_tokens,
            cp.public_block_keys,
            cp.immutable_blocks,
            tokens,
        )

    def route_request(self, req: WorkloadRequest, kp: KeyedPrompt, pool: str = "default") -> RouteRequest:
        """The `RouteRequest` the gateway's admission would build for `req`."""
        t = kp.tenant
        return RouteRequest(
            request_id=req.request_id,
            pool=pool,
            tenant=t.name,
            namespace=t.namespace,  # the own identity's, as the gateway's admission sets it
            block_keys=kp.block_keys,
            n_prompt_tokens=kp.n_tokens,
            block_size_tokens=kp.block_size_tokens,
            isolation=t.isolation,
            public_block_keys=kp.public_block_keys,
            immutable_blocks=kp.immutable_blocks,
            max_output_tokens=req.max_output_tokens,
            session_key=session_key(t, req.session),
        )

    def cache_salt(self, route: RouteRequest, decision: RouteDecision) -> str:
        """The salt the engine gets for `route` (`policies.identity.cache_salt_for`)."""
        tenant = self.tenant(route.tenant)
        return cache_salt_for(route, decision.shared_prefix_blocks, tenant.cache_salt, self.public_salt)


def _render_body(plan: RenderPlan, body: Mapping[str, object]) -> bytes:
    """What the emulated worker's render endpoint returns for `body` (its byte tokens)."""
    if plan.endpoint == "chat":
        return render_chat_body(body).encode()
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError("the simulator renders only string completion prompts")
    return prompt.encode()


def _render(plan: RenderPlan) -> bytes:
    return _render_body(plan, plan.body)
