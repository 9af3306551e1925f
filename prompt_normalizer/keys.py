"""Chained, identity-bound block keys.

    root = BLAKE2b-64(key = deployment secret, person = unit, canonical bytes of every KeyIdentity field)
    k0   = xxh3_64(block 0 bytes [+ extras], seed = root)
    ki   = xxh3_64(block i bytes [+ extras], seed = k(i-1))

Token blocks are hashed as little-endian uint32 token ids (a zero-copy numpy view, one xxh3 call per
block, no per-token Python work). Approximate-mode blocks are UTF-32-LE canonical text, under a
different `unit`, so text keys and token keys can never collide. `extras` fold the identity of
multimodal items into the block where their message starts. Only full blocks get a key: the
partial tail block is never keyed (engines cache full blocks only), so a prompt shorter than one
block has no keys at all.

The root is a keyed BLAKE2b so an outsider who knows a prompt cannot precompute its keys; the chain
stays keyed because every xxh3 seed descends from the root.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import orjson
import xxhash
from typing_extensions import Buffer

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.types import PUBLIC_NAMESPACE, BlockKey, KeyIdentity

TOKEN_UNIT = "tok-u32le-v1"
TOKEN_DTYPE = np.dtype("<u4")
_MAX_TOKEN_ID = 2**32 - 1
_U64 = (1 << 64) - 1

TokenArray = npt.NDArray[np.uint32]


def secret_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE2b key derived from a deployment secret of any length."""
    if not secret:
        raise NormalizerError("the deployment key secret must not be empty", code="bad_config")
    return hashlib.blake2b(secret, digest_size=32, person=b"kvgate-secret").digest()


def identity_bytes(identity: KeyIdentity) -> bytes:
    """Canonical bytes of every identity field (new fields are bound automatically)."""
    fields = {f.name: getattr(identity, f.name) for f in dataclasses.fields(identity)}
    return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)


def public_identity_of(identity: KeyIdentity) -> KeyIdentity:
    """The identity of a promoted public prefix: `identity` in every field but the namespace.

    The one place the public identity is derived, so public keys can never bind another model,
    weights, template, adapter, KV dtype or epoch than the tenant's own keys.
    """
    return dataclasses.replace(identity, namespace=PUBLIC_NAMESPACE)


def root_key(key: bytes, identity: KeyIdentity, unit: str = TOKEN_UNIT) -> int:
    """The chain root of `identity`: any differing field (or unit) gives an unrelated root."""
    digest = hashlib.blake2b(
        identity_bytes(identity), key=key, digest_size=8, person=unit.encode()[:16]
    ).digest()
    return int.from_bytes(digest, "little")


# The personalization of a multimodal part's digest (`canonical._media`).
MEDIA_PERSON = b"kvgate-media"


def keyed_digest(key: bytes, data: bytes, person: bytes = b"kvgate-field") -> bytes:
    """A 16-byte keyed digest of content, safe to keep in memory or print (no unkeyed hashes)."""
    return hashlib.blake2b(data, key=key, digest_size=16, person=person).digest()


def keyed_hasher(key: bytes, person: bytes) -> hashlib.blake2b:
    """A hasher holding `key` alone: a `copy()` of it updated with `data` digests to exactly
    `keyed_digest(key, data, person)`, without absorbing the key again (for many digests)."""
    return hashlib.blake2b(key=key, digest_size=16, person=person)


def as_tokens(ids: Sequence[int] | npt.NDArray[np.integer], *, param: str = "prompt") -> TokenArray:
    """Token ids as a contiguous little-endian uint32 array; out-of-range ids are a NormalizerError."""
    if isinstance(ids, np.ndarray) and ids.dtype == TOKEN_DTYPE:
        return np.ascontiguousarray(ids)
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, OverflowError):
        raise NormalizerError("token ids must be integers", param=param) from None
    if arr.ndim != 1:
        raise NormalizerError("token ids must be a flat list of integers", param=param)
    if arr.size and arr.dtype.kind not in "iu":  # floats, bools, strings, or ints beyond 64 bits
        raise NormalizerError("token ids must be integers", param=param)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID):
        raise NormalizerError("token ids must be in [0, 2**32)", param=param)
    return arr.astype(TOKEN_DTYPE)


Bytes = Buffer | npt.NDArray[Any]


def byte_view(data: Bytes) -> memoryview:
    """A flat byte view of bytes, a memoryview or a contiguous numpy array (no copy)."""
    if type(data) is bytes:  # approximate-mode text: already flat bytes
        return memoryview(data)
    view = data.data if isinstance(data, np.ndarray) else memoryview(data)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def chain_keys(
    data: Bytes,
    block_bytes: int,
    seed: int,
    extras: Mapping[int, bytes] | None = None,
) -> tuple[BlockKey, ...]:
    """Keys of the full `block_bytes` blocks of `data`, chained from `seed` (a root or a parent key)."""
    view = byte_view(data)
    if not extras:
        return chain_view(view, block_bytes, seed)
    end = len(view) - len(view) % block_bytes
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    prev = seed
    for i, start in enumerate(range(0, end, block_bytes)):
        chunk = view[start : start + block_bytes]
        extra = extras.get(i)
        prev = digest(bytes(chunk) + extra if extra else chunk, prev)
        keys.append(prev)
    return cast("tuple[BlockKey, ...]", tuple(keys))


def chain_view(view: bytes | memoryview, block_bytes: int, seed: int) -> tuple[BlockKey, ...]:
    """`chain_keys` of flat bytes or a flat byte view (see `byte_view`), with nothing folded in.

    The hot loop of every request: one C call per block, nothing else.
    """
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    append = keys.append
    prev = seed
    for start in range(0, len(view) - len(view) % block_bytes, block_bytes):
        prev = digest(view[start : start + block_bytes], prev)
        append(prev)
    return cast("tuple[BlockKey, ...]", tuple(keys))


class PrefixKeyMemo:
    """Bounded memory of the chained keys of recently seen leading spans (the immutable zone).

    Most requests repeat a tenant's system prompt and tools, so their leading keys repeat too; one
    xxh3-128 pass over the span replaces one xxh3 call per block. An entry is found by the seed
    (a root), the span length and a 128-bit fingerprint keyed from the deployment secret: a
    wrong hit needs a 128-bit collision, rarer than the 64-bit key collision the prefix index
    already accepts as "same content". Only keys and fingerprints are kept, never content.
    LRU-bounded by entries and by keys held in total; safe to share between threads.
    """

    def __init__(self, key: bytes, max_entries: int = 1024, max_keys: int = 262_144) -> None:
        self._seed = int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"kvgate-memo").digest())
        self._max_entries = max_entries
        self._max_keys = max_keys
        self._entries: OrderedDict[tuple[int, int, int], tuple[BlockKey, ...]] = OrderedDict()
        self._keys = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def fingerprint(self, span: Buffer) -> int:
        return xxhash.xxh3_128_intdigest(span, self._seed)

    def get(self, seed: int, n_bytes: int, fingerprint: int) -> tuple[BlockKey, ...] | None:
        """The remembered keys of a span of `n_bytes` with this fingerprint, chained from `seed`."""
        slot = (seed, n_bytes, fingerprint)
        keys = self._entries.get(slot)
        if keys is not None:
            # A hit takes no lock: `get` and `move_to_end` are each one C call that runs under the
            # GIL (the key is a tuple of ints), and an entry evicted between the two only makes
            # `move_to_end` raise; the keys found are still right. (`contextlib.suppress` would
            # build a context manager on every hit.)
            try:  # noqa: SIM105
                self._entries.move_to_end(slot)
            except KeyError:
                pass
        return keys

    def put(self, seed: int, n_bytes: int, fingerprint: int, keys: tuple[BlockKey, ...]) -> None:
        if len(keys) > self._max_keys:
            return
        slot = (seed, n_bytes, fingerprint)
        with self._lock:
            if slot not in self._entries:
                self._entries[slot] = keys
                self._keys += len(keys)
            while len(self._entries) > self._max_entries or self._keys > self._max_keys:
                _, old = self._entries.popitem(last=False)
                self._keys -= len(old)

    def chain(self, span: memoryview, fingerprint: int, block_bytes: int, seed: int) -> tuple[BlockKey, ...]:
        """The keys of `span` (whole blocks) chained from `seed`, from memory when seen before."""
        keys = self.get(seed, len(span), fingerprint)
        if keys is None:
            keys = chain_view(span, block_bytes, seed)  # outside the lock: the only slow part
            self.put(seed, len(span), fingerprint, keys)
        return keys


def token_block_keys(
    tokens: TokenArray, block_size_tokens: int, seed: int, extras: Mapping[int, bytes] | None = None
) -> tuple[BlockKey, ...]:
    """Chained keys of the full token blocks; the entry point for KV-event token ids too."""
    if block_size_tokens <= 0:
        raise NormalizerError("block_size_tokens must be positive", code="bad_config")
    return chain_keys(tokens, block_size_tokens * TOKEN_DTYPE.itemsize, seed, extras)


class IdentityTokenHasher:
    """Event-side twin of the request keys: `root(namespace, lora_name)` is the root of `identity`
    with that namespace and adapter, `chain(parent, ids)` the next key. It matches the
    `TokenBlockHasher` protocol of `policies.kv_feed` structurally.

    The adapter comes from the event alone: an engine names the LoRA adapter a block was computed
    with in `lora_name`, so an event without one comes from the base model, whatever adapter
    `identity` names. Build the hasher on the base model's identity: an adapter's requests are
    keyed as (base model, adapter), which is what an event's `lora_name` then resolves to.
    """

    def __init__(self, root_of: Callable[[KeyIdentity], int], identity: KeyIdentity) -> None:
        self._root_of = root_of
        self._identity = identity

    def root(self, namespace: str, lora_name: str | None) -> int:
        identity = dataclasses.replace(self._identity, namespace=namespace, adapter=lora_name or "")
        return self._root_of(identity)

    def chain(self, parent: int, token_ids: Sequence[int]) -> BlockKey:
        tokens = as_tokens(token_ids, param="token_ids")
        return BlockKey(xxhash.xxh3_64_intdigest(byte_view(tokens), int(parent) & _U64))
