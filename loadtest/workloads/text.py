"""Deterministic synthetic text: a key and a length always give the same ASCII string.

ASCII only, so with the emulator's byte tokenizer N characters are exactly N tokens. A block's
text depends only on its (salt, block id), and a partial block is a prefix of the full block's text,
so a trace's prefix structure survives the conversion to text byte for byte.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import xxhash

# Lower-case letters with spaces at roughly the frequency of English word breaks: readable enough in a
# log excerpt, and it never contains template control characters or multi-byte UTF-8.
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


def synth_bytes(key: str, n_chars: int) -> bytes:
    """`n_chars` ASCII bytes determined by `key` alone."""
    if n_chars <= 0:
        return b""
    rng = np.random.default_rng(xxhash.xxh64_intdigest(key.encode()))
    idx = rng.integers(0, len(_ALPHABET), size=n_chars, dtype=np.uint8)
    out = _ALPHABET[idx]
    out[0] = ord("x")  # never start with a space, so text never strips differently when joined
    return out.tobytes()


def synth_text(key: str, n_chars: int) -> str:
    return synth_bytes(key, n_chars).decode("ascii")


@lru_cache(maxsize=65_536)
def block_bytes(salt: str, block_id: int, block_size_tokens: int) -> bytes:
    """The full text of one trace block (bounded cache: about 32 MiB at 512-token blocks)."""
    return synth_bytes(f"blk\x1f{salt}\x1f{block_id}", block_size_tokens)
