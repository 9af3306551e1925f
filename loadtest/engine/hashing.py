"""Engine block hashes from token ids: a chain over full blocks, the cache salt in block 0.

    h_0 = H(root(seed) ‖ tokens[0:bs] ‖ salt)      h_i = H(h_{i-1} ‖ tokens[i·bs:(i+1)·bs])

H is BLAKE2b with an 8-byte digest read as an unsigned big-endian int (vLLM's event form is also
the low 64 bits of a digest). Like vLLM, which seeds its chain with a per-process random root
unless PYTHONHASHSEED is set, the root depends on a seed: routers must not assume they can
recompute engine hashes. Only full blocks are hashed; a trailing partial block has no hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from loadtest.engine.types import EngineRequest, RequestId


def _root(seed: int) -> bytes:
    return hashlib.blake2b(
        b"kvgate-engine-root" + seed.to_bytes(8, "big", signed=True), digest_size=8
    ).digest()


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    cache_salt: str | None = None,
    seed: int = 0,
) -> list[int]:
    """Chained hashes of every full block of `token_ids` (per block, no per-token Python loop)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = np.asarray(token_ids, dtype="<u4").tobytes()
    stride = 4 * block_size
    n_blocks = len(data) // stride
    salt = b"" if cache_salt is None else b"\x00salt\x00" + cache_salt.encode("utf-8")
    parent = _root(seed)
    out: list[int] = []
    view = memoryview(data)
    for i in range(n_blocks):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(view[i * stride : (i + 1) * stride])
        if i == 0 and salt:
            h.update(salt)
        parent = h.digest()
        out.append(int.from_bytes(parent, "big"))
    return out


def request_from_tokens(
    request_id: RequestId,
    prompt_token_ids: Sequence[int] | np.ndarray,
    max_output_tokens: int,
    block_size: int,
    cache_salt: str | None = None,
    output_token_ids: Sequence[int] | np.ndarray | None = None,
    seed: int = 0,
) -> EngineRequest:
    """An EngineRequest whose hashes cover the prompt and, when given, the known output tokens
    (so that a later turn that repeats this answer hits on it, as in vLLM)."""
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    if output_token_ids is not None and len(output_token_ids) > 0:
        full = np.concatenate([prompt, np.asarray(output_token_ids, dtype=np.int64)[:max_output_tokens]])
    else:
        full = prompt
    return EngineRequest(
        request_id=request_id,
        num_prompt_tokens=len(prompt),
        max_output_tokens=max_output_tokens,
        block_hashes=block_hashes(full, block_size, cache_salt, seed),
    )
