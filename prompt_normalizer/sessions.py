"""Which session a request belongs to, and the drift observer its keys are compared with.

A session is named by a header value (`session_key`), else by the first of the pool's
`session_fields` that holds a string in the body. Only a keyed digest bound to the identity's
namespace is kept, so the drift memory (`drift.DriftTracker`) holds no client text and two
tenants' equal `user` values are different sessions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from prompt_normalizer.canonical import CanonicalChat, FieldItem, field_items
from prompt_normalizer.config import NormalizerConfig
from prompt_normalizer.drift import DriftTracker
from prompt_normalizer.keys import keyed_digest
from prompt_normalizer.layout import DriftObserver
from prompt_normalizer.types import BlockKey, DriftReport, KeyIdentity, Zone, ZoneSpan


class SessionDrift:
    """The rule that names a request's session, and the sessions' bounded drift memory."""

    def __init__(self, config: NormalizerConfig, key: bytes) -> None:
        self._key = key
        self._fields = config.session_fields
        self._drift = DriftTracker(config.drift_sessions_max, config.drift_store_max_blocks)

    def __len__(self) -> int:
        return len(self._drift)

    def digest(
        self, body: Mapping[str, Any], identity: KeyIdentity, session_key: str | None = None
    ) -> bytes | None:
        """Keyed session id: a header value if given, else the first configured body field."""
        value = session_key
        if value is None:
            for name in self._fields:
                candidate = body.get(name)
                if isinstance(candidate, str) and candidate:
                    value = candidate
                    break
        if value is None:
            return None
        return keyed_digest(self._key, orjson.dumps([identity.namespace, value]), b"kvgate-session")

    def observer(
        self,
        body: Mapping[str, Any],
        identity: KeyIdentity,
        session_key: str | None,
        chat: CanonicalChat | None,
        block_size: int,
    ) -> DriftObserver | None:
        """What `layout.assemble` calls with the request's keys, or None when it names no session."""
        session = self.digest(body, identity, session_key)
        if session is None:
            return None
        items = field_items(chat, self._key) if chat is not None else _prompt_items(body, self._key)
        return functools.partial(self._observe, session, block_size, items)

    def _observe(
        self,
        session: bytes,
        block_size: int,
        items: tuple[FieldItem, ...],
        keys: tuple[BlockKey, ...],
        stable_end_token: int,
        zones: tuple[ZoneSpan, ...],
    ) -> DriftReport:
        return self._drift.observe(session, keys, stable_end_token, block_size, items, zones)

    def observe_pending(self, pending: PendingDrift, keys: tuple[BlockKey, ...]) -> DriftReport:
        """The report for an observation taken elsewhere (`DeferredDrift`), as `_observe` makes it."""
        return self._drift.observe(
            pending.session, keys, pending.stable_end_token, pending.block_size, pending.items, pending.zones
        )


@dataclass(frozen=True, slots=True)
class PendingDrift:
    """A drift observation taken where a request was keyed, to be made where its session's
    memory is kept (`Normalizer.observe_pending`): the keyed session id and field digests with the
    zones, never content. The keys are the prompt's own `block_keys`. `sources` names a converted
    request's own fields (`converted.relabel_drift`)."""

    session: bytes
    block_size: int
    items: tuple[FieldItem, ...]
    stable_end_token: int
    zones: tuple[ZoneSpan, ...]
    sources: tuple[str, ...] | None = None


# What a deferring normalizer's request carries until its drift is observed: no first differing
# block, so `layout.assemble` adds no drift line to its diagnostics.
_UNSEEN = DriftReport(session_seen=False, first_diff_block=None, shared_blocks=0, previous_blocks=0)


class DeferredDrift(SessionDrift):
    """Session naming without a memory: records each observation as a `PendingDrift` (taken
    with `take`) for a normalizer in another process to observe. For one request at a time."""

    def __init__(self, config: NormalizerConfig, key: bytes) -> None:
        super().__init__(config, key)
        self.pending: PendingDrift | None = None

    def take(self) -> PendingDrift | None:
        pending, self.pending = self.pending, None
        return pending

    def _observe(
        self,
        session: bytes,
        block_size: int,
        items: tuple[FieldItem, ...],
        keys: tuple[BlockKey, ...],
        stable_end_token: int,
        zones: tuple[ZoneSpan, ...],
    ) -> DriftReport:
        self.pending = PendingDrift(session, block_size, items, stable_end_token, zones)
        return _UNSEEN


def _prompt_items(body: Mapping[str, Any], key: bytes) -> tuple[FieldItem, ...]:
    digest = keyed_digest(key, orjson.dumps(body.get("prompt"), option=orjson.OPT_SORT_KEYS))
    return (FieldItem("prompt", Zone.APPEND_ONLY, digest),)
