"""What the simulator needs from one worker's engine model, as structural types.

`loadtest.engine.Engine` (the engine model shared with the emulated worker) satisfies these
protocols as it is; the loop depends only on the few fields listed here, so it stays independent of
how the engine batches, caches and evicts, and tests can drive it with a small scripted engine.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol


class FirstTokenLike(Protocol):
    @property
    def request_id(self) -> Hashable: ...
    @property
    def num_cached_tokens(self) -> int: ...


class FinishedLike(Protocol):
    @property
    def request_id(self) -> Hashable: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...


class StoredLike(Protocol):
    """Blocks `first_block_index ..` of request `request_id` entered the cache."""

    @property
    def request_id(self) -> Hashable: ...
    @property
    def first_block_index(self) -> int: ...
    @property
    def block_hashes(self) -> tuple[int, ...]: ...
    @property
    def parent_block_hash(self) -> int | None: ...


class KvChanges(Protocol):
    """Blocks that entered and left a prefix cache (a step's, or a KV transfer's install)."""

    @property
    def stored(self) -> Sequence[StoredLike]: ...
    @property
    def removed(self) -> Sequence[int]: ...


class StepLike(Protocol):
    """One engine step (or a run of coalesced decode steps); everything in it happens at `end_s`."""

    @property
    def duration_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def first_tokens(self) -> Sequence[FirstTokenLike]: ...
    @property
    def finished(self) -> Sequence[FinishedLike]: ...
    @property
    def stored(self) -> Sequence[StoredLike]: ...
    @property
    def removed(self) -> Sequence[int]: ...


class StatsLike(Protocol):
    """What a metrics scrape of the worker shows."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...


class SimEngine(Protocol):
    """One worker's engine. `submit` raises ValueError for a request it can never serve."""

    block_size: int

    def submit(self, req: Any) -> None: ...

    def has_work(self) -> bool: ...

    def step(self, now_s: float, until_s: float | None = None) -> StepLike | None: ...

    def stats(self) -> StatsLike: ...


class PdEngine(SimEngine, Protocol):
    """An engine that can take part in a prefill/decode split (`loadtest.engine.Engine` can)."""

    def prefix_hit_tokens(self, block_hashes: Sequence[int], num_prompt_tokens: int) -> int: ...

    def install_blocks(self, owner: Any, block_hashes: Sequence[int]) -> KvChanges: ...

    def hold_blocks(self, hold_id: Hashable, block_hashes: Sequence[int]) -> int: ...

    def release_hold(self, hold_id: Hashable) -> bool: ...


# (request_id, num_prompt_tokens, max_output_tokens, block_hashes) -> the engine's request record.
RequestFactory = Callable[[str, int, int, Sequence[int]], Any]
