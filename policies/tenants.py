"""Public-prefix promotion, and each tenant's sharing settings in the policy file.

Every tenant's keys live in its own namespace (`policies.identity`; the normalizer binds the
namespace into the key root), so a tenant can never match another tenant's private chain. An
immutable-zone chain (system prompt, tools, few-shot) may be promoted to the public namespace:
- by an operator allow-list of chain keys (keyed hashes, never content), or
- when at least `min_tenants` distinct opted-in tenants (isolation `shared_public` or `public`)
  presented it within `window_s`.
A promoted chain that nobody used for `cool_after_s` is demoted (allow-listed chains stay).
Promotions and demotions are counted and queued as events carrying only the keyed hash.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.base import Isolation, RouteRequest
from policies.identity import wholly_public
from prompt_normalizer.types import BlockKey

_STRICTNESS = {Isolation.PUBLIC: 0, Isolation.SHARED_PUBLIC: 1, Isolation.STRICT: 2}


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """One tenant's sharing settings; `index_share` caps its share of a pool's index (None: default)."""

    isolation: Isolation = Isolation.STRICT
    index_share: float | None = None


@dataclass(frozen=True, slots=True)
class PromotionConfig:
    """When an immutable chain becomes public, and when it stops being public."""

    min_tenants: int = 3
    window_s: float = 600.0
    cool_after_s: float = 1800.0
    allow_list: frozenset[BlockKey] = frozenset()
    max_candidates: int = 10_000

    def __post_init__(self) -> None:
        if self.min_tenants < 1:
            raise ValueError("min_tenants must be >= 1")
        if self.window_s <= 0 or self.cool_after_s <= 0:
            raise ValueError("window_s and cool_after_s must be > 0")


@dataclass(frozen=True, slots=True)
class PromotionEvent:
    """A promotion or demotion, identified only by the chain's keyed hash."""

    kind: str
    chain_key_hex: str
    at_s: float
    reason: str


@dataclass(slots=True)
class _Candidate:
    tenants: OrderedDict[str, float] = field(default_factory=OrderedDict)


def effective_isolation(req: RouteRequest, settings: Mapping[str, TenantSettings]) -> Isolation:
    """The stricter of what the request says and what the policy file says for its tenant."""
    configured = settings.get(req.tenant)
    if configured is None:
        return req.isolation
    a, b = req.isolation, configured.isolation
    return a if _STRICTNESS[a] >= _STRICTNESS[b] else b


def wholly_public_blocks(req: RouteRequest, isolation: Isolation, n_public: int) -> int:
    """`n_public` when `req`, routed on `n_public` public blocks, will carry the public `cache_salt`
    (`policies.identity.wholly_public`), else 0: a public-namespace holding saves it nothing then."""
    return n_public if wholly_public(req, n_public, isolation) else 0


def chain_key_hex(key: BlockKey) -> str:
    return f"{key:016x}"


class PublicPrefixes:
    """Tracks candidate immutable chains and which of them are currently public."""

    MAX_EVENTS = 1024

    def __init__(self, config: PromotionConfig) -> None:
        self.config = config
        self._candidates: OrderedDict[BlockKey, _Candidate] = OrderedDict()
        self._promoted: OrderedDict[BlockKey, float] = OrderedDict()
        self.events: deque[PromotionEvent] = deque(maxlen=self.MAX_EVENTS)
        self.promotions = 0
        self.demotions = 0

    @staticmethod
    def public_blocks(req: RouteRequest) -> int:
        """How many leading blocks of `req` form its immutable chain under the public namespace."""
        return min(req.immutable_blocks, len(req.public_block_keys))

    def observe(self, req: RouteRequest, isolation: Isolation, now_s: float) -> int:
        """Count `req` toward promotion; return the public blocks it may use (0: none).

        Strict tenants neither count toward promotion nor use public chains.
        """
        self._demote_cold(now_s)
        n = self.public_blocks(req)
        if n == 0 or isolation is Isolation.STRICT:
            return 0
        key = req.public_block_keys[n - 1]
        if key in self._promoted or key in self.config.allow_list:
            self._touch_promoted(key, now_s, "allow_list")
            return n
        cand = self._candidates.get(key)
        if cand is None:
            cand = self._candidates[key] = _Candidate()
            if len(self._candidates) > self.config.max_candidates:
                self._candidates.popitem(last=False)
        else:
            self._candidates.move_to_end(key)
        tenants = cand.tenants
        tenants.pop(req.tenant, None)
        tenants[req.tenant] = now_s
        horizon = now_s - self.config.window_s
        while tenants and next(iter(tenants.values())) < horizon:
            tenants.popitem(last=False)
        # Only the most recent `min_tenants` matter for the decision; keep the map that small.
        while len(tenants) > self.config.min_tenants:
            tenants.popitem(last=False)
        if len(tenants) >= self.config.min_tenants:
            del self._candidates[key]
            self._touch_promoted(key, now_s, "tenants")
            return n
        return 0

    def tick(self, now_s: float) -> None:
        """Demote chains gone cold (also done by every `observe`)."""
        if self._promoted:
            self._demote_cold(now_s)

    def is_public(self, key: BlockKey) -> bool:
        return key in self._promoted or key in self.config.allow_list

    def _touch_promoted(self, key: BlockKey, now_s: float, reason: str) -> None:
        if key not in self._promoted:
            self.promotions += 1
            self.events.append(PromotionEvent("promote", chain_key_hex(key), now_s, reason))
        else:
            self._promoted.move_to_end(key)
        self._promoted[key] = now_s

    def _demote_cold(self, now_s: float) -> None:
        horizon = now_s - self.config.cool_after_s
        promoted = self._promoted
        while promoted:
            key, last = next(iter(promoted.items()))
            if last >= horizon:
                break
            del promoted[key]
            if key not in self.config.allow_list:
                self.demotions += 1
                self.events.append(PromotionEvent("demote", chain_key_hex(key), now_s, "cold"))

    def promoted_count(self) -> int:
        return len(self._promoted)
