"""Chained block keys of a request, for ceilings and for the keys a policy sees.

Identity: a block chain is rooted at `xxh3_64(namespace, salt)` and each key folds in the parent
key, so two requests share key i only when they share the namespace and blocks 0..i. For a
`BlockPrompt` read at its own block size the trace's ids are chained directly (one key per trace
block, the last one possibly partial); otherwise the rendered bytes are cut into full blocks of
`block_size_tokens` bytes (= tokens for the byte tokenizer) and each block's bytes are chained.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from loadtest.workloads.records import BlockPrompt, WorkloadRequest
from loadtest.workloads.render import ChatRenderer, plain_chat_template, prompt_bytes

_PAIR = struct.Struct("<QQ")
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockChain:
    """Keys of a request's leading blocks and how many of its tokens they cover.

    Block i covers `min(block_size_tokens, keyed_tokens - i*block_size_tokens)` tokens; tokens past
    `keyed_tokens` have no key (a partial tail the trace did not hash) and can never be a hit.
    """

    keys: tuple[int, ...]
    block_size_tokens: int
    keyed_tokens: int
    n_tokens: int

    def hit_tokens(self, n_hit_blocks: int) -> int:
        return min(n_hit_blocks * self.block_size_tokens, self.keyed_tokens)


def chain_root(namespace: str, salt: str = "") -> int:
    return xxhash.xxh3_64_intdigest(f"{namespace}\x1f{salt}".encode())


def chain_ids(root: int, ids: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """k0 = H(root, id0), ki = H(k(i-1), id i)."""
    keys: list[int] = []
    prev = root
    digest = xxhash.xxh3_64_intdigest
    pack = _PAIR.pack
    for block_id in ids:
        prev = digest(pack(prev, block_id & _MASK))
        keys.append(prev)
    return tuple(keys)


def chain_bytes(root: int, data: bytes, block_size_tokens: int) -> tuple[int, ...]:
    """Keys of the full `block_size_tokens`-byte blocks of `data`; a partial tail gets no key."""
    keys: list[int] = []
    prev = root
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - block_size_tokens + 1, block_size_tokens):
        prev = digest(data[start : start + block_size_tokens], seed=prev)
        keys.append(prev)
    return tuple(keys)


def request_chain(
    req: WorkloadRequest,
    namespace: str,
    block_size_tokens: int | None = None,
    chat_renderer: ChatRenderer = plain_chat_template,
) -> BlockChain:
    """The chain of `req` under `namespace`; `block_size_tokens=None` keeps a trace's own block size."""
    prompt = req.prompt
    if isinstance(prompt, BlockPrompt) and block_size_tokens in (None, prompt.block_size_tokens):
        size = prompt.block_size_tokens
        keys = chain_ids(chain_root(namespace, prompt.salt), prompt.block_ids)
        return BlockChain(keys, size, min(len(keys) * size, prompt.n_tokens), prompt.n_tokens)
    size = block_size_tokens or 16
    data = prompt_bytes(req, chat_renderer)
    keys = chain_bytes(chain_root(namespace), data, size)
    return BlockChain(keys, size, len(keys) * size, len(data))
