"""Signed sync batches: only a holder of the deployment's key-hash secret can make one a peer applies.

A broker admits anyone holding its token (docs/sync.md, "Broker authentication"), and everything a
batch says is acted on: a tenant's quota charges, holdings on real workers, a sender's sequence
number. So every batch is sealed under a key only the deployment's gateways have, and a receiver
opens it, verifying the tag in constant time, before it reads anything of the batch:

    b"\\xc1kv" | version (1 byte) | body (the msgpack map, `codec`) | tag (32 bytes)

    tag = HMAC-SHA256(derive_secret(key-hash secret, "sync_batches"), everything before the tag)

The tag covers the header and the whole body: the origin, the sequence number, the send time,
the pools' fingerprints and every item, load and quota row. The key is a sub-secret of this
purpose alone (`policies.identity.derive_secret`), never the key-hash secret itself. 0xc1 is the
one byte msgpack never uses, so a gateway of an earlier release, which reads a batch as a msgpack
map, refuses a sealed one at its first byte as malformed, and this one refuses the bare map of an
earlier release here, before reading it.

What the tag does not give: a holder of the key-hash secret (any gateway of the deployment, or
whoever took one's secret) can still seal anything, and a sealed batch can be sent again; copies
are what `sequence` and the send time's bounds (`codec.MAX_CLOCK_SKEW_S`) keep out.
"""

from __future__ import annotations

import hashlib
import hmac

from gateway.sync.wire_read import MalformedBatch
from policies.identity import derive_secret

WIRE_VERSION = 2  # 1: the bare msgpack map, unsigned
_MAGIC = b"\xc1kv"
_HEAD = _MAGIC + bytes([WIRE_VERSION])
TAG_BYTES = 32
ENVELOPE_BYTES = len(_HEAD) + TAG_BYTES  # what sealing adds to a batch's body
_PURPOSE = "sync_batches"


class BadSignature(MalformedBatch):
    """Bytes that are not a batch sealed under this deployment's key: an earlier release's bare
    batch, another version's, or one made up or altered by someone without the key-hash secret
    (another deployment's gateway on the same subject too). Its own type so that a receiver
    counts it apart from a sealed batch that does not decode."""


class BatchKey:
    """The key a deployment's gateways seal their batches with, derived from the key-hash secret."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        self._key = derive_secret(secret, _PURPOSE)

    def seal(self, body: bytes) -> bytes:
        """`body` (an encoded batch) with the header in front and its tag after."""
        mac = hmac.new(self._key, _HEAD, hashlib.sha256)
        mac.update(body)
        return b"".join((_HEAD, body, mac.digest()))

    def open(self, data: bytes) -> memoryview:
        """The body of sealed batch `data`, once its tag verifies; else `BadSignature`. Reads
        nothing of the body before that."""
        if len(data) < ENVELOPE_BYTES or data[: len(_MAGIC)] != _MAGIC:
            raise BadSignature("not a signed sync batch")
        if data[len(_MAGIC)] != WIRE_VERSION:
            raise BadSignature("a sync batch of another version")
        view = memoryview(data)
        tag = hmac.digest(self._key, view[:-TAG_BYTES], "sha256")
        if not hmac.compare_digest(tag, view[-TAG_BYTES:]):
            raise BadSignature("signature does not verify")
        return view[len(_HEAD) : -TAG_BYTES]
