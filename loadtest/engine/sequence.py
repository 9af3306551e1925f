"""Engine configuration and the per-request state the scheduler mutates."""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.engine.types import EngineRequest


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine limits; None means "take the profile's value"."""

    kv_blocks: int | None = None
    block_size_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_waiting_requests: int = 65536
    jitter_frac: float = 0.0  # sigma of a per-step lognormal factor (mean 1); 0 = deterministic
    seed: int = 0


class Seq:
    """Mutable per-request state. `num_tokens` = prompt + tokens generated so far (vLLM's
    num_tokens); the engine schedules `num_tokens - computed` tokens, and when `computed` reaches
    `num_tokens` the step samples a new token. Blocks held = `n_cached_blocks` (a prefix of
    `hashes`, referenced in the pool) + `n_private` (allocated, not in the cache)."""

    __slots__ = (
        "computed",
        "external",
        "generated",
        "hashes",
        "max_output",
        "n_cached_blocks",
        "n_private",
        "num_cached_tokens",
        "num_prompt",
        "num_tokens",
        "preemptions",
        "request_id",
        "running",
    )

    def __init__(self, req: EngineRequest) -> None:
        self.request_id = req.request_id
        self.hashes = req.block_hashes
        self.num_prompt = req.num_prompt_tokens
        self.max_output = req.max_output_tokens
        self.num_tokens = req.num_prompt_tokens
        self.computed = 0
        self.external = req.num_external_tokens  # received KV; dropped on preemption
        self.generated = 0
        self.n_cached_blocks = 0
        self.n_private = 0
        self.num_cached_tokens = -1  # set once, at first scheduling (vLLM's num_cached_tokens)
        self.preemptions = 0
        self.running = False
