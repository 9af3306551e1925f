"""Where a request's prefix is looked up in the index, per the salt its KV is computed with.

A request keeps its tenant's salt (`OwnKeys`: its keys and namespace; a `public` tenant's request
keyed in the public namespace is re-scoped to the tenant, `tenant_scoped`) unless it lies wholly
inside a promoted public prefix, whose public-namespace match is then the one that counts
(`Lookup`). The salt rules themselves are `policies.identity`'s.
"""

from __future__ import annotations

from policies.base import WorkerId
from policies.index import PrefixMatch
from policies.records import record
from prompt_normalizer.types import BlockKey

_MASK64 = (1 << 64) - 1


@record
class OwnKeys:
    """The keys and index namespace of the worker KV a request uses when it keeps its tenant's salt."""

    keys: tuple[BlockKey, ...]
    namespace: str


@record
class Lookup:
    """One request's view of the index: the match that can save it prefill.

    `public_blocks` > 0: the request lies wholly inside a promoted public prefix and will carry the
    public salt, so only the public-namespace match counts (`own` is empty). Otherwise it keeps its
    tenant's salt and only its own-namespace match counts (`public` is empty).
    """

    own: PrefixMatch
    public: PrefixMatch
    public_blocks: int

    def blocks(self, worker: WorkerId) -> int:
        return max(self.own.blocks(worker), self.public.blocks(worker))

    @property
    def longest_blocks(self) -> int:
        return max(self.own.longest_blocks, self.public.longest_blocks)


def tenant_scoped(keys: tuple[BlockKey, ...], tenant: str) -> tuple[BlockKey, ...]:
    """`keys` re-scoped to `tenant`: a bijection per tenant (splitmix64 finalizer of key ^ tenant
    seed), so distinct keys stay distinct, and a key still names its whole prefix, now for this
    tenant's salt only."""
    t = 0x9E3779B97F4A7C15
    for ch in tenant.encode():
        t = ((t ^ ch) * 0x100000001B3) & _MASK64
    out = []
    for k in keys:
        z = (k ^ t) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(BlockKey(z ^ (z >> 31)))
    return tuple(out)
