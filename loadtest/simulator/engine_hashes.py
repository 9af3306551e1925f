"""Engine block hashes of a workload request, without per-token Python work.

Trace prompts (`BlockPrompt`) carry no text worth hashing: engine block k of trace block j gets
`mix(K_j, k)`, where `K_j` is the engine's chained key of trace block j: the normalizer's chain
(`prompt_normalizer.keys.chain_keys`) over the ids as u64, seeded from the cache salt and the
trace's id space, not from the deployment secret (an engine never knows it). K_j already encodes the
whole prefix up to block j, so equal engine hashes still mean equal prefixes, and a partial last
trace block yields the same leading engine blocks as the full block in a later request. Full engine
blocks of an unhashed tail get hashes unique to the request. All of it is a few numpy operations per
request (splitmix64 finalizer).

Chat and text prompts are hashed from their token ids (the rendered bytes) by the engine's own
`block_hashes`, exactly as the emulated worker hashes them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from loadtest.workloads.records import BlockPrompt, WorkloadRequest
from prompt_normalizer.keys import chain_keys

TokenHasher = Callable[[np.ndarray, int, str | None], list[int]]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def block_prompt_hashes(
    prompt: BlockPrompt, engine_block_tokens: int, cache_salt: str | None, tail_key: str
) -> list[int]:
    """Hashes of the full engine blocks of a trace prompt (see the module docstring)."""
    size = prompt.block_size_tokens
    if size % engine_block_tokens:
        raise ValueError(
            f"trace block of {size} tokens is not a multiple of the engine block ({engine_block_tokens})"
        )
    sub = size // engine_block_tokens
    n_engine = prompt.n_tokens // engine_block_tokens
    ids = np.asarray(prompt.block_ids, dtype=np.uint64)
    root = xxhash.xxh3_64_intdigest(f"engine\x1f{cache_salt or ''}\x1f{prompt.salt}".encode())
    keys = np.array(chain_keys(ids, 8, root), dtype=np.uint64)
    k = np.arange(1, sub + 1, dtype=np.uint64) * _GOLDEN
    with np.errstate(over="ignore"):
        hashes = _mix(_mix(keys)[:, None] + k[None, :]).reshape(-1)
    n_traced = min(n_engine, hashes.size)
    out: list[int] = hashes[:n_traced].tolist()
    if n_engine > n_traced:
        seed = np.uint64(
            xxhash.xxh3_64_intdigest(f"tail\x1f{cache_salt}\x1f{prompt.salt}\x1f{tail_key}".encode())
        )
        with np.errstate(over="ignore"):
            tail = _mix(np.arange(1, n_engine - n_traced + 1, dtype=np.uint64) * _GOLDEN + seed)
        out.extend(tail.tolist())
    return out


def request_hashes(
    req: WorkloadRequest,
    prompt: bytes | None,
    engine_block_tokens: int,
    cache_salt: str | None,
    token_hasher: TokenHasher,
) -> list[int]:
    """The engine hashes of `req`'s prompt (`prompt` is its rendered bytes)."""
    if isinstance(req.prompt, BlockPrompt):
        return block_prompt_hashes(req.prompt, engine_block_tokens, cache_salt, req.request_id)
    if prompt is None:
        raise ValueError("chat and text prompts need their rendered bytes")
    return token_hasher(np.frombuffer(prompt, dtype=np.uint8), engine_block_tokens, cache_salt)
