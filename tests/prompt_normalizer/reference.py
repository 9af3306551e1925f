"""An independent, slow reference of the key recipe (docs/normalizer.md), for checking the fast one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

import xxhash

from prompt_normalizer.types import KeyIdentity


def reference_root(secret: bytes, identity: KeyIdentity, unit: str = "tok-u32le-v1") -> int:
    key = hashlib.blake2b(secret, digest_size=32, person=b"kvgate-secret").digest()
    fields = {f.name: getattr(identity, f.name) for f in dataclasses.fields(identity)}
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.blake2b(payload, key=key, digest_size=8, person=unit.encode()).digest()
    return int.from_bytes(digest, "little")


def reference_keys(secret: bytes, identity: KeyIdentity, tokens: list[int]) -> list[int]:
    bs = identity.block_size_tokens
    prev = reference_root(secret, identity)
    keys = []
    for start in range(0, len(tokens) - bs + 1, bs):
        block = struct.pack(f"<{bs}I", *tokens[start : start + bs])
        prev = xxhash.xxh3_64_intdigest(block, seed=prev)
        keys.append(prev)
    return keys
