"""Records exchanged with the engine: the request a caller submits and what one step reports."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

RequestId = Hashable
"""Any hashable caller-chosen id (a string in the emulator, an int in the simulator)."""


class EngineRejected(ValueError):
    """The engine can never serve this request (too long for the KV pool, queue full, bad fields)."""


class EngineQueueFull(EngineRejected):
    """The waiting queue is at its bound; the same request may be accepted later."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request as the engine sees it: token counts plus chained block hashes.

    `block_hashes[i]` is the engine hash of full block i of the sequence (prompt tokens first, then
    output tokens), chained so that equal hashes mean equal prefixes (salt included in block 0).
    It may cover only the prompt, or even fewer blocks (then the rest is computed but never cached);
    entries past `(num_prompt_tokens + max_output_tokens) // block_size` are rejected at submit.
    Build it with `loadtest.engine.hashing.request_from_tokens` when token ids are at hand, or pass
    precomputed hashes (e.g. derived from a trace's hash ids) without materializing any text.

    `num_external_tokens` > 0 says the KV of the first that many prompt tokens was received from
    another engine (a remote prefill): at its first admission the request starts with
    `min(num_external_tokens, num_prompt_tokens - 1)` tokens computed, as vLLM does after a KV
    transfer, provided the full blocks they span are in the prefix cache (install them first with
    `Engine.install_blocks`); otherwise only the cached blocks count. The tokens count as cached.
    A preempted request loses what was not in full cached blocks and recomputes it.
    """

    request_id: RequestId
    num_prompt_tokens: int
    max_output_tokens: int
    block_hashes: Sequence[int] = ()
    num_external_tokens: int = 0


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A request produced its first output token in this step."""

    request_id: RequestId
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request produced its last output token in this step; its blocks are released."""

    request_id: RequestId
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A run of full blocks of one request entered the prefix cache (vLLM's BlockStored).

    Block `first_block_index + j` of the request's sequence has hash `block_hashes[j]`; the caller
    that holds token ids slices them from the request to fill the event's `token_ids`.
    """

    request_id: RequestId
    first_block_index: int
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None


@dataclass(frozen=True, slots=True)
class InstalledBlocks:
    """What `Engine.install_blocks` did to the prefix cache.

    The first `num_blocks` of the given hashes are now cached (newly stored or already there);
    `stored` lists the newly stored runs (BlockStored events) and `removed` the hashes evicted to
    make room (BlockRemoved events). Fewer than all blocks are cached when the pool has no room
    left for the rest (every other block is in use).
    """

    num_blocks: int
    stored: tuple[BlocksStored, ...]
    removed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one call to `Engine.step` did. All state changes are already applied.

    `num_steps` > 1 only when the caller allowed coalescing pure-decode steps (`until_s`); then every
    request in `emitted` produced `num_steps` tokens, otherwise each produced exactly one.
    Tokens, first tokens and finishes become visible at `end_s`.
    """

    start_s: float
    duration_s: float
    num_steps: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_requests: int
    emitted: tuple[RequestId, ...]
    first_tokens: tuple[FirstToken, ...]
    finished: tuple[FinishedRequest, ...]
    preempted: tuple[RequestId, ...]
    stored: tuple[BlocksStored, ...] = field(default=())
    removed: tuple[int, ...] = field(default=())

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters and gauges in the shape of vLLM's /metrics (token counts, not request counts)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    num_finished_total: int
    waiting_prompt_tokens: int

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks referenced by running requests (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_kv_blocks
