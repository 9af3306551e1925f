"""Which session a request belongs to, and the drift observer its keys are compared with.

A session is named by a header value (`session_key`), else by the first of the pool's
`session_fields` that holds a string in the body. Only a keyed digest bound to the identity's
namespace is kept, so the drift memory (`drift.DriftTracker`) holds no client text and two
tenants' equal `user` values are different sessions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
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


def _prompt_items(body: Mapping[str, Any], key: bytes) -> tuple[FieldItem, ...]:
    digest = keyed_digest(key, orjson.dumps(body.get("prompt"), option=orjson.OPT_SORT_KEYS))
    return (FieldItem("prompt", Zone.APPEND_ONLY, digest),)
