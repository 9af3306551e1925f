"""The emulated worker's core: one Engine stepped in (scaled) real time by a background task.

Request handlers `submit` a GenerationRequest and then wait on its `LiveRequest`, which the step
loop advances once per engine step (one output token per step per running request). The model
clock is `(monotonic() - start) * time_scale`; a step's results become visible after sleeping
`duration_s / time_scale` real seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.live import KvEventSink, LiveGroup, LiveRequest, StoredBlocks
from loadtest.emulator.logprobs import LogprobWriter
from loadtest.emulator.metrics import LatencyStats
from loadtest.emulator.output import AnswerWriter
from loadtest.emulator.pooling import Pooler
from loadtest.emulator.protocol import GenerationRequest
from loadtest.emulator.stops import cut_at_stop
from loadtest.engine import (
    Engine,
    EngineConfig,
    EngineQueueFull,
    EngineRejected,
    EngineRequest,
    EngineStats,
    InstalledBlocks,
    StepResult,
    block_hashes,
    load_profile,
)
from loadtest.engine.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("loadtest.emulator")
# The request field a too-long prompt is reported against, per endpoint.
_PROMPT_PARAM = {"chat": "messages", "completions": "prompt", "responses": "input", "messages": "messages"}


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
        self.logprob_writer = LogprobWriter(self.tokenizer, cfg.seed)
        self.pooler = Pooler(cfg.seed)  # embeddings, classes and scores for the pooling routes
        self.sink = sink
        self.latency = LatencyStats()
        self._live: dict[str, LiveRequest] = {}
        self._gone: dict[str, LiveRequest] = {}  # aborted during the step in flight
        self._wakeup = asyncio.Event()
        self._start = time.monotonic()
        self.num_aborted = 0
        self.num_stopped = 0  # finished by a stop string or a tool call: vLLM's finished_reason "stop"

    # ------------------------------------------------------------------ clock

    def model_now_s(self) -> float:
        return (time.monotonic() - self._start) * self.cfg.time_scale

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        gen: GenerationRequest,
        response_id: str,
        external_tokens: int = 0,
        on_finish: Callable[[LiveRequest], None] | None = None,
    ) -> LiveGroup:
        """Queue every sequence of a validated request (all or none); ApiError if one can never
        run or the queue is full. `external_tokens`: prompt tokens whose KV was received from a
        prefill worker (installed first); `on_finish` runs when each sequence finishes."""
        tool_answer = None
        if gen.tool_call is not None:
            # As vLLM: stop strings end the generated text, and the tool parser reads what is left.
            tool_answer = cut_at_stop(self.answers.fixed_answer(gen.tool_call.arguments), gen.stop)
            if tool_answer.stop_reason is not None and not gen.tool_call.named:
                gen = dataclasses.replace(gen, tool_call=None)  # no whole call left: the text is the answer
        window = self.max_model_len
        if tool_answer is None and gen.max_tokens > window:
            # vLLM 0.33 refuses only a budget past the window (`TokenizeParams`) ...
            raise ApiError.bad_request(
                f"{gen.budget_field}={gen.max_tokens} cannot be greater than max_model_len={window}. "
                "Please request fewer output tokens.",
                gen.budget_field,
            )
        budgets: list[int] = []
        for prompt in gen.prompts:
            # Checked before building answers: max_tokens is untrusted.
            if tool_answer is None:
                # ... and shortens one up to it to what the prompt leaves (`get_max_tokens`); a
                # prompt that leaves nothing is refused.
                if len(prompt) >= window:
                    raise ApiError.bad_request(
                        f"This model's maximum context length is {window} tokens. However, your prompt "
                        f"contains {len(prompt)} input tokens, which exceeds this limit even without any "
                        "output tokens. Please reduce the length of the input prompt.",
                        _PROMPT_PARAM[gen.endpoint],
                    )
                budgets.append(min(gen.max_tokens, window - len(prompt)))
                continue
            total = len(prompt) + len(tool_answer.pieces)  # the call's length is fixed
            if total > window:
                raise ApiError.bad_request(
                    f"This model's maximum context length is {window} tokens. However, you "
                    f"requested {total} tokens ({len(prompt)} in the messages, {len(tool_answer.pieces)} "
                    "in the completion). Please reduce the length of the messages or completion.",
                    _PROMPT_PARAM[gen.endpoint],
                )
            budgets.append(len(tool_answer.pieces))
        event = asyncio.Event()
        lives: list[LiveRequest] = []
        try:
            for p, prompt in enumerate(gen.prompts):
                for c in range(gen.n):
                    answer = tool_answer or cut_at_stop(
                        self.answers.text_answer(prompt, budgets[p], variant=c), gen.stop
                    )
                    live = LiveRequest(gen, prompt, answer, p * gen.n + c, event)
                    live.on_finish = on_finish
                    if gen.logprobs is not None:
                        live.logprobs = self.logprob_writer.for_answer(answer, gen.logprobs)
                    hashes = block_hashes(live.seq_token_ids, self.block_size, gen.cache_salt, self.cfg.seed)
                    self.engine.submit(
                        EngineRequest(
                            live.request_id, len(prompt), len(answer.pieces), hashes, external_tokens
                        )
                    )
                    self._live[live.request_id] = live
                    lives.append(live)
        except (EngineQueueFull, EngineRejected) as exc:
            for live in lives:  # all or none: withdraw the sequences already queued
                self._drop(live)
            if isinstance(exc, EngineQueueFull):
                raise ApiError.unavailable(str(exc)) from exc
            raise ApiError.bad_request(str(exc)) from exc
        self._wakeup.set()
        return LiveGroup(gen, response_id, lives, event)

    def abort(self, group: LiveGroup) -> None:
        """Client went away: drop the sequences still running and free their blocks."""
        for live in group.lives:
            if not live.finished and live.request_id in self._live:
                self._drop(live)
                self.num_aborted += 1

    def _drop(self, live: LiveRequest) -> None:
        del self._live[live.request_id]
        self._gone[live.request_id] = live
        self.engine.abort(live.request_id)

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
            self._finished(live)
        self._live.clear()

    def _finished(self, live: LiveRequest) -> None:
        if live.on_finish is not None:
            try:
                live.on_finish(live)
            except Exception:  # a broken hook must not stop the step loop
                log.exception("finish hook failed")
        live.event.set()

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
                if live.finish_reason != "length":
                    self.num_stopped += 1
                self._finished(live)
                self.latency.observe_e2e((now - live.arrival_s) * self.cfg.time_scale)

    def publish_installed(self, installed: InstalledBlocks, prompt_ids: np.ndarray, salt: str | None) -> None:
        """KV events for blocks received from a prefill worker (BlockStored, and BlockRemoved
        for what their installation evicted)."""
        if self.sink is None or not (installed.stored or installed.removed):
            return
        bs = self.block_size
        stored = [
            StoredBlocks(
                st.block_hashes,
                st.parent_block_hash,
                prompt_ids[
                    st.first_block_index * bs : (st.first_block_index + len(st.block_hashes)) * bs
                ].tolist(),
                salt,
                st.first_block_index,
            )
            for st in installed.stored
        ]
        try:
            self.sink.publish(stored, installed.removed, bs)
        except Exception:  # a broken event socket must not fail the request
            log.exception("KV event publish failed")

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
