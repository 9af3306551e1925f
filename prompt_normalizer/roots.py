"""Chain roots per key identity, cached and bounded, and the public identity derived from each.

A root is a keyed BLAKE2b of the identity (keys.root_key); recomputing it, or even hashing the
nine-field identity dataclass, on every request costs more than the rest of a short request's
keys. Callers keep one `KeyIdentity` object per tenant and model, so entries are found by object
identity first. Safe to share between threads (the gateway may normalize in a worker thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import TOKEN_UNIT, public_identity_of, root_key
from prompt_normalizer.types import KeyIdentity

ROOT_CACHE_MAX = 4096


@dataclass(frozen=True, slots=True)
class UnitRoots:
    """The roots one request chains from: its own, and the public one when public keys are asked."""

    root: int
    public_root: int | None


@dataclass(slots=True)
class IdentityRoots:
    """Chain roots of one identity object and of its public twin, per hashing unit."""

    identity: KeyIdentity
    public: KeyIdentity
    # Per unit, without and with the public root: built once, handed to every request.
    private_only: dict[str, UnitRoots] = field(default_factory=dict)
    with_public: dict[str, UnitRoots] = field(default_factory=dict)
    # The last `public_identity` object a caller passed that equals `public` (skips the compare).
    accepted_public: KeyIdentity | None = None


class RootCache:
    """Bounded caches of roots by identity value and by identity object (LRU, thread-safe)."""

    def __init__(self, key: bytes, max_entries: int = ROOT_CACHE_MAX) -> None:
        self._key = key
        self._max = max_entries
        self._lock = threading.Lock()
        self._roots: OrderedDict[tuple[KeyIdentity, str], int] = OrderedDict()
        # By id(); an entry holds its identity object, so the id is not reused while it lives.
        self._objects: OrderedDict[int, IdentityRoots] = OrderedDict()

    def root(self, identity: KeyIdentity, unit: str = TOKEN_UNIT) -> int:
        """The chain root for `identity` under `unit`."""
        cache_key = (identity, unit)
        root = self._roots.get(cache_key)
        if root is None:
            root = root_key(self._key, identity, unit)
            with self._lock:
                self._roots[cache_key] = root
                while len(self._roots) > self._max:
                    self._roots.popitem(last=False)
        return root

    def entry(self, identity: KeyIdentity, public_identity: KeyIdentity | None) -> IdentityRoots:
        """The cached roots of `identity`; checks that a given `public_identity` is its public twin.

        An identity is checked before its entry is cached (a frozen identity stays valid), so a
        request under a known identity pays for no check."""
        entry = self._objects.get(id(identity))
        if entry is None or entry.identity is not identity:
            if identity.block_size_tokens <= 0:
                raise NormalizerError("block_size_tokens must be positive", code="bad_config")
            entry = IdentityRoots(identity, public_identity_of(identity))
            with self._lock:
                self._objects[id(identity)] = entry
                while len(self._objects) > self._max:
                    self._objects.popitem(last=False)
        if public_identity is not None and public_identity is not entry.accepted_public:
            # Public keys are always derived from the request identity; a caller's public identity
            # that differs in any field but the namespace would bind another model or epoch.
            if public_identity != entry.public:
                raise NormalizerError(
                    "public_identity must equal the request identity with the public namespace",
                    code="bad_identity",
                )
            entry.accepted_public = public_identity
        return entry

    def unit_roots(self, identity: KeyIdentity, public_identity: KeyIdentity | None, unit: str) -> UnitRoots:
        """The roots a request under `identity` chains from (`entry` and `for_unit` in one step,
        with the same checks)."""
        entry = self._objects.get(id(identity))
        if (
            entry is None
            or entry.identity is not identity
            or (public_identity is not None and public_identity is not entry.accepted_public)
        ):
            entry = self.entry(identity, public_identity)  # creates the entry, checks the public twin
        roots = (entry.with_public if public_identity is not None else entry.private_only).get(unit)
        return roots if roots is not None else self.for_unit(entry, unit, public_identity is not None)

    def for_unit(self, entry: IdentityRoots, unit: str, with_public: bool) -> UnitRoots:
        cached = entry.with_public if with_public else entry.private_only
        roots = cached.get(unit)
        if roots is None:
            public = self.root(entry.public, unit) if with_public else None
            roots = cached[unit] = UnitRoots(self.root(entry.identity, unit), public)
        return roots
