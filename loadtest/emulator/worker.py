"""The emulated worker's core: one Engine stepped in (scaled) real time by a background task.

Request handlers `submit` a GenerationRequest and then wait on its `LiveRequest`, which the step
loop advances once per engine step (one output token per step per running request). The model
clock is `(monotonic() - start) * time_scale`; a step's results become visible after sleeping
`duration_s / time_scale` real seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.metrics import LatencyStats
from loadtest.emulator.output import Answer, AnswerWriter
from loadtest.emulator.protocol import GenerationRequest
from loadtest.engine import (
    Engine,
    EngineConfig,
    EngineQueueFull,
    EngineRejected,
    EngineRequest,
    EngineStats,
    StepResult,
    block_hashes,
    load_profile,
)
from loadtest.engine.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("loadtest.emulator")


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
    """A request in flight, as its HTTP handler sees it. Updated only by the step loop."""

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
        "produced",
        "request_id",
        "salt",
        "seq_token_ids",
    )

    def __init__(self, gen: GenerationRequest, answer: Answer, prefix: str) -> None:
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.gen = gen
        self.answer = answer
        self.salt = gen.cache_salt
        self.seq_token_ids = np.concatenate([gen.prompt_ids, answer.token_ids[: len(answer.pieces)]])
        self.created = int(time.time())
        self.produced = 0
        self.cached_tokens = 0
        self.finished = False
        self.failed = False  # the engine raised: the handler answers 500 instead of waiting forever
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None
        self.event = asyncio.Event()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.gen.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.answer.pieces)

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class EmulatedWorker:
    """Engine + step loop + live requests; no HTTP here (see `app.py`)."""

    def __init__(self, cfg: EmulatorConfig, sink: KvEventSink | None = None) -> None:
        self.cfg = cfg
        self.profile = load_profile(cfg.profile)
        self.engine = Engine(
            self.profile,
            EngineConfig(
                kv_blocks=cfg.kv_blocks,
                block_size_tokens=cfg.block_size,
                max_waiting_requests=cfg.max_waiting_requests,
                jitter_frac=cfg.jitter_frac,
                seed=cfg.seed,
            ),
        )
        self.block_size = self.engine.block_size
        self.num_blocks = self.engine.num_blocks
        self.max_model_len = min(cfg.max_model_len, self.num_blocks * self.block_size)
        self.tokenizer: Tokenizer = load_tokenizer(cfg.tokenizer)
        self.answers = AnswerWriter(self.tokenizer, cfg.seed)
        self.sink = sink
        self.latency = LatencyStats()
        self._live: dict[str, LiveRequest] = {}
        self._gone: dict[str, LiveRequest] = {}  # aborted during the step in flight
        self._wakeup = asyncio.Event()
        self._start = time.monotonic()
        self.num_aborted = 0

    # ------------------------------------------------------------------ clock

    def model_now_s(self) -> float:
        return (time.monotonic() - self._start) * self.cfg.time_scale

    # ------------------------------------------------------------------ requests

    def submit(self, gen: GenerationRequest) -> LiveRequest:
        """Queue a validated request; ApiError if it can never run or the queue is full."""
        n_prompt = len(gen.prompt_ids)
        if gen.tool_call is not None:
            answer = self.answers.fixed_answer(gen.tool_call.arguments)
            n_output = len(answer.pieces)
        else:
            n_output = gen.max_tokens
        total = n_prompt + n_output
        if total > self.max_model_len:  # checked before building the answer: max_tokens is untrusted
            raise ApiError.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({n_prompt} in the messages, {n_output} in the completion). "
                "Please reduce the length of the messages or completion.",
                "messages" if gen.endpoint == "chat" else "prompt",
            )
        if gen.tool_call is None:
            answer = self.answers.text_answer(gen.prompt_ids, gen.max_tokens)
        live = LiveRequest(gen, answer, "chatcmpl" if gen.endpoint == "chat" else "cmpl")
        hashes = block_hashes(live.seq_token_ids, self.block_size, gen.cache_salt, self.cfg.seed)
        req = EngineRequest(live.request_id, n_prompt, len(answer.pieces), hashes)
        try:
            self.engine.submit(req)
        except EngineQueueFull as exc:
            raise ApiError.unavailable(str(exc)) from exc
        except EngineRejected as exc:
            raise ApiError.bad_request(str(exc)) from exc
        self._live[live.request_id] = live
        self._wakeup.set()
        return live

    def abort(self, live: LiveRequest) -> None:
        """Client went away: drop the request and free its blocks."""
        if live.finished or live.request_id not in self._live:
            return
        del self._live[live.request_id]
        self._gone[live.request_id] = live
        self.engine.abort(live.request_id)
        self.num_aborted += 1

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        dropped = self.engine.reset_prefix_cache()
        if dropped is None:
            return False
        if self.sink is not None:
            self.sink.publish_all_cleared()
        return True

    # ------------------------------------------------------------------ step loop

    async def run(self) -> None:
        """The step loop; runs until cancelled (owned by the app lifespan)."""
        scale = self.cfg.time_scale
        busy_until_s: float | None = None  # model time the previous step ended, while busy
        while True:
            if not self.engine.has_work():
                busy_until_s = None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Back-to-back steps start where the previous one ended in model time, so a late
            # wake-up of this process (CPU contention, timer resolution) is caught up instead of
            # accumulating into every later token; after idling, a step starts now.
            start_s = busy_until_s if busy_until_s is not None else self.model_now_s()
            try:
                res = self.engine.step(start_s)
            except Exception:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all()
                busy_until_s = None
                continue
            if res is None:
                continue
            busy_until_s = res.end_s
            delay = self._start + res.end_s / scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._deliver(res)

    def _fail_all(self) -> None:
        for live in list(self._live.values()):
            self.engine.abort(live.request_id)
            live.failed = True
            live.finished = True
            live.event.set()
        self._live.clear()

    def _lookup(self, request_id: object) -> LiveRequest | None:
        key = str(request_id)
        return self._live.get(key) or self._gone.get(key)

    def _deliver(self, res: StepResult) -> None:
        if self.sink is not None and (res.stored or res.removed):
            self._publish(res)
        self._gone.clear()
        now = time.monotonic()
        for ft in res.first_tokens:
            live = self._live.get(str(ft.request_id))
            if live is not None:
                live.cached_tokens = ft.num_cached_tokens
                live.first_token_s = now
                self.latency.observe_ttft((now - live.arrival_s) * self.cfg.time_scale)
        for rid in res.emitted:
            live = self._live.get(str(rid))
            if live is not None:
                live.produced += res.num_steps
                live.event.set()
        for fin in res.finished:
            live = self._live.pop(str(fin.request_id), None)
            if live is not None:
                live.finished = True
                live.event.set()
                self.latency.observe_e2e((now - live.arrival_s) * self.cfg.time_scale)

    def _publish(self, res: StepResult) -> None:
        assert self.sink is not None
        bs = self.block_size
        stored: list[StoredBlocks] = []
        for st in res.stored:
            live = self._lookup(st.request_id)
            if live is None:
                continue
            lo = st.first_block_index * bs
            tokens = live.seq_token_ids[lo : lo + len(st.block_hashes) * bs].tolist()
            stored.append(
                StoredBlocks(st.block_hashes, st.parent_block_hash, tokens, live.salt, st.first_block_index)
            )
        try:
            self.sink.publish(stored, res.removed, bs)
        except Exception:  # a broken event socket must not stop token generation
            log.exception("KV event publish failed")
