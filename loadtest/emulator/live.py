"""What a request handler holds while its sequences run: `LiveRequest` (one prompt and choice),
`LiveGroup` (all sequences of one HTTP request), and the KV-event records the step loop emits.

The step loop in `worker.py` is the only writer; handlers read and wait on them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from loadtest.emulator.logprobs import TokenLogprob
from loadtest.emulator.output import Answer
from loadtest.emulator.protocol import GenerationRequest


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """One BlockStored run with the tokens of its blocks (for a KV-event sink)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: list[int]
    cache_salt: str | None
    first_block_index: int


class KvEventSink(Protocol):
    """Receives the cache changes of each step (the ZMQ publisher implements it)."""

    def publish(self, stored: Sequence[StoredBlocks], removed: Sequence[int], block_size: int) -> None: ...

    def publish_all_cleared(self) -> None: ...


class LiveRequest:
    """One sequence in flight (a prompt and one choice), as its handler sees it.

    Updated only by the step loop. `index` is the choice index in the answer (`prompt * n +
    choice`); `request_id` is the engine's id, unique even when clients reuse their ids.
    """

    __slots__ = (
        "answer",
        "arrival_s",
        "cached_tokens",
        "created",
        "event",
        "failed",
        "finished",
        "first_token_s",
        "gen",
        "index",
        "logprobs",
        "on_finish",
        "produced",
        "prompt_ids",
        "request_id",
        "salt",
        "seq_token_ids",
    )

    def __init__(
        self,
        gen: GenerationRequest,
        prompt_ids: np.ndarray,
        answer: Answer,
        index: int = 0,
        event: asyncio.Event | None = None,
    ) -> None:
        self.request_id = uuid.uuid4().hex
        self.gen = gen
        self.prompt_ids = prompt_ids
        self.index = index
        self.answer = answer
        self.logprobs: tuple[TokenLogprob, ...] = ()
        self.salt = gen.cache_salt
        self.seq_token_ids = np.concatenate([prompt_ids, answer.token_ids[: len(answer.pieces)]])
        self.created = int(time.time())
        self.produced = 0
        self.cached_tokens = 0
        self.finished = False
        self.failed = False  # the engine raised: the handler answers 500 instead of waiting forever
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None
        self.event = event if event is not None else asyncio.Event()
        # Called by the step loop once the sequence finished (or failed), before its handler
        # wakes: a prefill worker holds the prompt's blocks there for a KV transfer.
        self.on_finish: Callable[[LiveRequest], None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.answer.pieces)

    @property
    def finish_reason(self) -> str:
        """vLLM's `finish_reason` once finished: "stop" when a stop string ended the generated
        text (a named tool call's too: vLLM reports the output's own reason for it), else
        "tool_calls" for a call and "length" for text, which runs to its token limit."""
        if self.answer.stop_reason is not None:
            return "stop"
        return "tool_calls" if self.gen.tool_call is not None else "length"

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class LiveGroup:
    """The sequences of one HTTP request (every prompt times `n` choices), woken by one event.

    `lives[p * n + c]` is choice `c` of prompt `p`; `response_id` is the id the answer carries.
    """

    __slots__ = ("created", "event", "gen", "kv_transfer_params", "lives", "response_id")

    def __init__(
        self, gen: GenerationRequest, response_id: str, lives: list[LiveRequest], event: asyncio.Event
    ) -> None:
        self.gen = gen
        self.response_id = response_id
        self.lives = tuple(lives)
        self.event = event
        self.created = int(time.time())
        # vLLM's `kv_transfer_params` of the answer: where a decode worker pulls this prompt's KV.
        self.kv_transfer_params: dict[str, object] | None = None

    @property
    def finished(self) -> bool:
        return all(live.finished for live in self.lives)

    @property
    def failed(self) -> bool:
        return any(live.failed for live in self.lives)

    @property
    def first_of_each_prompt(self) -> tuple[LiveRequest, ...]:
        """Choice 0 of every prompt: prompt tokens and cache hits are counted once per prompt."""
        return self.lives[:: self.gen.n]

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()
