"""Drift diagnostics: where a session's prompt stopped extending the previous one.

Per session the tracker keeps only keyed material: the block keys, where the stable content ended,
and a keyed digest per request field. Comparing a new request with the previous one gives the first
differing block and the first field (in model-input order) whose digest changed or vanished: a
path such as `tools[2]` or `messages[0].content`, never content. Memory is bounded by a session
count and a total number of stored keys (least recently seen sessions go first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from prompt_normalizer.canonical import FieldItem
from prompt_normalizer.types import BlockKey, DriftReport, Zone, ZoneSpan


@dataclass(frozen=True, slots=True)
class _Record:
    keys: npt.NDArray[np.uint64]
    stable_blocks: int
    items: tuple[FieldItem, ...]


def _shared_prefix(a: npt.NDArray[np.uint64], b: npt.NDArray[np.uint64]) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def _zone_at(zones: tuple[ZoneSpan, ...], token: int) -> Zone | None:
    for span in zones:
        if span.start_token <= token < span.end_token:
            return span.zone
    return None


class DriftTracker:
    """Bounded per-session memory of the last request, keyed by a keyed session digest
    (thread-safe: one request's compare-and-replace is atomic)."""

    def __init__(self, max_sessions: int, max_blocks: int) -> None:
        self._max_sessions = max_sessions
        self._max_blocks = max_blocks
        self._records: OrderedDict[bytes, _Record] = OrderedDict()
        self._blocks = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def stored_blocks(self) -> int:
        return self._blocks

    def observe(
        self,
        session: bytes,
        keys: tuple[BlockKey, ...],
        stable_end_token: int,
        block_size: int,
        items: tuple[FieldItem, ...],
        zones: tuple[ZoneSpan, ...],
    ) -> DriftReport:
        """Compare with the session's previous request, then remember this one."""
        arr = np.fromiter(keys, dtype=np.uint64, count=len(keys))
        with self._lock:
            prev = self._records.pop(session, None)
            if prev is not None:
                self._blocks -= len(prev.keys)
            self._store(session, _Record(arr, stable_end_token // block_size, items))
        if prev is None:
            return DriftReport(session_seen=False, first_diff_block=None, shared_blocks=0, previous_blocks=0)
        shared = _shared_prefix(prev.keys, arr)
        if shared >= prev.stable_blocks:
            return DriftReport(True, None, shared, len(prev.keys))
        field, zone = self._first_field(prev.items, items)
        if zone is None:
            zone = _zone_at(zones, shared * block_size)
        return DriftReport(True, shared, shared, len(prev.keys), zone, field)

    @staticmethod
    def _first_field(
        before: tuple[FieldItem, ...], after: tuple[FieldItem, ...]
    ) -> tuple[str | None, Zone | None]:
        now = {item.path: item.digest for item in after}
        for item in before:
            if item.zone is Zone.VOLATILE:
                continue
            digest = now.get(item.path)
            if digest != item.digest:
                return (item.path if digest is not None else f"{item.path} (removed)"), item.zone
        return None, None

    def _store(self, session: bytes, record: _Record) -> None:
        if self._max_sessions <= 0 or len(record.keys) > self._max_blocks:
            return
        self._records[session] = record
        self._blocks += len(record.keys)
        while len(self._records) > self._max_sessions or self._blocks > self._max_blocks:
            _, old = self._records.popitem(last=False)
            self._blocks -= len(old.keys)
