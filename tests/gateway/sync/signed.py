"""Sync batches as the tests' gateways seal them: one key-hash secret (their pools' fingerprints
and their batches' key, `gateway.sync.signing`), and the codec's calls under its key."""

from __future__ import annotations

from typing import Any

import msgpack

from gateway.sync import codec
from gateway.sync.codec import SyncBatch
from gateway.sync.signing import ENVELOPE_BYTES, TAG_BYTES, BatchKey

SECRET = b"sync-test-secret"  # the deployment's key-hash secret (its pools' fingerprints, its batches' key)
KEY = BatchKey(SECRET)


def encode(batch: SyncBatch, secret: bytes = SECRET) -> bytes:
    """`batch` sealed as a gateway of key-hash secret `secret` seals it."""
    return codec.encode(batch, KEY if secret == SECRET else BatchKey(secret))


def decode(data: bytes, now_wall_s: float | None = None) -> SyncBatch:
    """`data` read as a gateway of `SECRET` reads it."""
    return codec.decode(data, KEY, now_wall_s)


def sealed(doc: dict[str, Any] | bytes) -> bytes:
    """A batch body (a msgpack map, or its bytes as they are), sealed under `KEY`: what only a
    holder of the secret can send, made to the test's measure."""
    return KEY.seal(doc if isinstance(doc, bytes) else msgpack.packb(doc, use_bin_type=True))


def body(data: bytes) -> bytes:
    """The body (the msgpack map's bytes) of sealed batch `data`, unverified."""
    return data[ENVELOPE_BYTES - TAG_BYTES : -TAG_BYTES]


def doc_of(data: bytes) -> dict[str, Any]:
    """The msgpack map of sealed batch `data`, to be changed and sealed again (`sealed`)."""
    found = msgpack.unpackb(body(data), raw=False)
    assert isinstance(found, dict)
    return found
