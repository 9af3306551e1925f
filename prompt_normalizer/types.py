"""Typed records shared by the normalizer and its consumers (policies, gateway, loadtest)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NewType

# A 64-bit chained block key: k0 = H(root, block0), ki = H(k(i-1), block i).
BlockKey = NewType("BlockKey", int)

PUBLIC_NAMESPACE = "public"


class Zone(enum.StrEnum):
    """Where a span of the model input sits in the prefix-stability order."""

    IMMUTABLE = "immutable"
    APPEND_ONLY = "append_only"
    VOLATILE = "volatile"


@dataclass(frozen=True, slots=True)
class ZoneSpan:
    """A half-open token span `[start_token, end_token)` of one zone, with the request field it came from."""

    zone: Zone
    source: str
    start_token: int
    end_token: int


@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """Everything a prefix key is valid for. Any field that differs gives disjoint keys.

    `namespace` is the tenant namespace, or `PUBLIC_NAMESPACE` for promoted public prefixes.
    """

    model_id: str
    weights_version: str = ""
    tokenizer_version: str = ""
    template_version: str = ""
    adapter: str = ""
    block_size_tokens: int = 16
    kv_dtype: str = "auto"
    namespace: str = PUBLIC_NAMESPACE
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class DriftReport:
    """How this request's model input departs from the previous request of the same session.

    `first_diff_block` is the first block whose key differs (or `None` when the request extends the
    previous one); `zone` and `field` say where: `field` is a request path such as `tools[2]` or
    `messages[0].content`, never content. `shared_blocks` is how many leading keys both share.
    """

    session_seen: bool
    first_diff_block: int | None
    shared_blocks: int
    previous_blocks: int
    zone: Zone | None = None
    field: str | None = None


@dataclass(frozen=True, slots=True)
class CanonicalPrompt:
    """The normalizer's answer for one request.

    `block_keys` covers only full blocks of `block_size_tokens`; the partial tail block has no key
    (no engine caches a partial block). `diagnostics` name the canonicalization switches and
    volatile rules that changed something, by field path, never by content. `public_block_keys`
    are the keys of the leading immutable-zone blocks computed under the public namespace, so a
    promoted public prefix can be looked up; it is empty when the request has no full immutable
    block.
    """

    n_tokens: int
    block_size_tokens: int
    block_keys: tuple[BlockKey, ...]
    zones: tuple[ZoneSpan, ...]
    public_block_keys: tuple[BlockKey, ...] = ()
    diagnostics: tuple[str, ...] = field(default=())
    # The request body to forward upstream when canonicalization changed it (the keys describe this
    # body, not the original); `None` means forward the original body unchanged.
    canonical_body: Mapping[str, Any] | None = None
    drift: DriftReport | None = None

    @property
    def immutable_blocks(self) -> int:
        """Number of full blocks that lie entirely inside the immutable zone."""
        end = 0
        for span in self.zones:
            if span.zone is not Zone.IMMUTABLE or span.start_token != end:
                break
            end = span.end_token
        return end // self.block_size_tokens
