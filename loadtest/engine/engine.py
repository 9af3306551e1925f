"""The engine: vLLM V1-style continuous batching over a `BlockPool`, timed by a `StepProfile`.

Clock-free: the caller passes `now_s` to `step` and decides when the next step starts (the
emulator sleeps `duration_s` in real time, the simulator advances a virtual clock).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence

from loadtest.engine.batch import batch_shape
from loadtest.engine.block_pool import BlockPool
from loadtest.engine.decode_run import decode_run_length
from loadtest.engine.profile import StepProfile
from loadtest.engine.sequence import EngineConfig, Seq
from loadtest.engine.transfer import BlockHolds, HoldId, install_chain
from loadtest.engine.types import (
    BlocksStored,
    EngineQueueFull,
    EngineRejected,
    EngineRequest,
    EngineStats,
    FinishedRequest,
    FirstToken,
    InstalledBlocks,
    RequestId,
    StepResult,
)

__all__ = ["Engine", "EngineConfig"]


class Engine:
    """One emulated vLLM engine. See the package docstring for the driving protocol."""

    def __init__(self, profile: StepProfile, config: EngineConfig | None = None) -> None:
        cfg = config or EngineConfig()
        self.profile = profile
        self.block_size = cfg.block_size_tokens or profile.block_size_tokens
        self.num_blocks = cfg.kv_blocks or profile.kv_blocks
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or profile.max_num_batched_tokens
        self.max_num_seqs = cfg.max_num_seqs or profile.max_num_seqs
        self.max_waiting_requests = cfg.max_waiting_requests
        if min(self.block_size, self.num_blocks, self.max_num_batched_tokens, self.max_num_seqs) <= 0:
            raise ValueError("engine limits must be positive")
        self._jitter = cfg.jitter_frac
        self._rng = random.Random(cfg.seed)
        self._pool = BlockPool(self.num_blocks)
        self._holds = BlockHolds(self._pool)
        self._seqs: dict[RequestId, Seq] = {}
        self._running: list[Seq] = []
        self._waiting: deque[Seq] = deque()
        self._waiting_tokens = 0
        self._queries = 0
        self._hits = 0
        self._prompt_total = 0
        self._generation_total = 0
        self._preemptions_total = 0
        self._finished_total = 0

    # ------------------------------------------------------------------ caller API

    def submit(self, req: EngineRequest) -> None:
        """Queue a request (FCFS). Raises EngineRejected if it can never run."""
        if req.request_id in self._seqs:
            raise EngineRejected(f"duplicate request id {req.request_id!r}")
        if req.num_prompt_tokens < 1:
            raise EngineRejected("prompt must have at least one token")
        if req.max_output_tokens < 1:
            raise EngineRejected("max_output_tokens must be at least 1")
        if req.num_external_tokens < 0:
            raise EngineRejected("num_external_tokens must not be negative")
        total = req.num_prompt_tokens + req.max_output_tokens
        if len(req.block_hashes) > total // self.block_size:
            raise EngineRejected("more block hashes than full blocks in the sequence")
        needed = -(-total // self.block_size)
        if needed > self.num_blocks:
            raise EngineRejected(
                f"prompt plus max_tokens is {total} tokens, more than this engine's KV capacity of "
                f"{self.num_blocks * self.block_size} tokens"
            )
        if len(self._waiting) >= self.max_waiting_requests:
            raise EngineQueueFull(f"waiting queue is full ({self.max_waiting_requests} requests)")
        seq = Seq(req)
        self._seqs[req.request_id] = seq
        self._waiting.append(seq)
        self._waiting_tokens += seq.num_tokens

    def abort(self, request_id: RequestId) -> bool:
        """Drop a request wherever it is and release its blocks. False if unknown or finished.

        A step already returned keeps listing it; callers ignore ids they aborted.
        """
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.running:
            self._running.remove(seq)
            self._free(seq)
        else:
            self._waiting.remove(seq)
            self._waiting_tokens -= seq.num_tokens
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def reset_prefix_cache(self) -> list[int] | None:
        """Drop every unreferenced cached block (vLLM refuses while blocks are in use: None)."""
        return self._pool.clear()

    # ------------------------------------------------------------------ KV transfer (P/D)

    def prefix_hit_tokens(self, block_hashes: Sequence[int], num_prompt_tokens: int) -> int:
        """Prompt tokens a request with these hashes would find cached now (no state change)."""
        limit = max(0, num_prompt_tokens - 1) // self.block_size
        return self._pool.lookup(block_hashes, limit).num_blocks * self.block_size

    def install_blocks(self, owner: RequestId, block_hashes: Sequence[int]) -> InstalledBlocks:
        """Cache received blocks (a KV transfer's full blocks, block 0 first); see `transfer`."""
        return install_chain(self._pool, owner, block_hashes)

    def hold_blocks(self, hold_id: HoldId, block_hashes: Sequence[int]) -> int:
        """Pin the cached leading blocks of a chain until `release_hold`; returns how many."""
        return self._holds.hold(hold_id, block_hashes)

    def release_hold(self, hold_id: HoldId) -> bool:
        return self._holds.release(hold_id)

    def stats(self) -> EngineStats:
        pool = self._pool
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_kv_blocks=self.num_blocks,
            num_used_blocks=self.num_blocks - pool.available,
            num_cached_blocks=pool.num_cached,
            prefix_cache_queries_tokens=self._queries,
            prefix_cache_hits_tokens=self._hits,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._generation_total,
            num_preemptions_total=self._preemptions_total,
            num_finished_total=self._finished_total,
            waiting_prompt_tokens=self._waiting_tokens,
        )

    def step(self, now_s: float, until_s: float | None = None) -> StepResult | None:
        """Schedule and run one step starting at `now_s`; None when there is nothing to do.

        With `until_s` (e.g. the next arrival the caller knows of), consecutive pure-decode steps
        that all start before `until_s` are coalesced into one result, as long as no request
        finishes, is admitted or is preempted inside the run.
        """
        if not self._running and not self._waiting:
            return None
        bs = self.block_size
        pool = self._pool
        budget = self.max_num_batched_tokens
        sched: list[Seq] = []
        counts: list[int] = []
        preempted: list[RequestId] = []

        # 1. Running requests, in order: decodes take one token, prefills a chunk.
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = seq.num_tokens - seq.computed
            if n > budget:
                n = budget
            need = -(-(seq.computed + n) // bs) - seq.n_cached_blocks - seq.n_private
            scheduled = True
            # (A decode usually needs no new block: skip asking the pool what is available.)
            while need > 0 and need > pool.available:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                break
            if need > 0:
                pool.allocate(need)
                seq.n_private += need
            sched.append(seq)
            counts.append(n)
            budget -= n
            i += 1

        # 2. Waiting requests, FCFS, with a prefix-cache lookup; the first that does not fit stops
        #    admission (head-of-line), and nothing is admitted in a step that preempted.
        waiting = self._waiting
        while waiting and budget > 0 and not preempted and len(running) < self.max_num_seqs:
            seq = waiting[0]
            hit = pool.lookup(seq.hashes, (seq.num_tokens - 1) // bs)
            cached = hit.num_blocks * bs
            if seq.external > cached:
                # Received KV counts when the full blocks it spans are cached; its tail sits in a
                # private block allocated below.
                external = min(seq.external, seq.num_tokens - 1)
                if hit.num_blocks >= external // bs:
                    cached = external
            n = min(seq.num_tokens - cached, budget)
            need = -(-(cached + n) // bs) - hit.num_blocks
            if need + hit.num_evictable > pool.available:
                break
            pool.acquire(seq.hashes, hit.num_blocks)
            pool.allocate(need)
            waiting.popleft()
            self._waiting_tokens -= seq.num_tokens
            seq.n_cached_blocks = hit.num_blocks
            seq.n_private = need
            seq.computed = cached
            seq.running = True
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = cached
                self._queries += seq.num_prompt
                self._hits += cached
            running.append(seq)
            sched.append(seq)
            counts.append(n)
            budget -= n

        if not sched:
            # Only reachable when a lone request preempted itself, which submit() rules out.
            raise RuntimeError("engine could not schedule any request")

        # 3. Step time from the profile.
        shape = batch_shape(sched, counts)
        prefill_tokens, decode_reqs = shape.prefill_tokens, shape.decode_requests
        num_tokens = prefill_tokens + decode_reqs
        duration_s = self.profile.step_time_s(
            num_tokens, len(sched), shape.context_tokens, shape.attention_pairs
        )

        if prefill_tokens == 0 and until_s is not None and not waiting and not preempted:
            k, duration_s = decode_run_length(
                sched, duration_s, now_s, until_s, self.block_size, self._pool.available,
                self.profile.d_ms_per_context_token / 1000.0,
            )  # fmt: skip
            if k > 1:
                return self._apply_decode_run(now_s, sched, k, duration_s)

        # 4. Apply the step.
        stored: list[BlocksStored] = []
        emitted: list[RequestId] = []
        first: list[FirstToken] = []
        finished: list[FinishedRequest] = []
        for seq, n in zip(sched, counts, strict=True):
            seq.computed += n
            if seq.computed // bs > seq.n_cached_blocks:  # a block became full (`_promote`)
                self._promote(seq, stored)
            if seq.computed == seq.num_tokens:
                seq.generated += 1
                seq.num_tokens += 1
                self._generation_total += 1
                emitted.append(seq.request_id)
                if seq.generated == 1:
                    self._prompt_total += seq.num_prompt
                    first.append(FirstToken(seq.request_id, seq.num_cached_tokens))
                if seq.generated >= seq.max_output:
                    finished.append(self._finish(seq))
        if finished:
            self._running = [s for s in running if s.running]
        return self._result(
            now_s, duration_s, 1, num_tokens, prefill_tokens, decode_reqs, emitted, first, finished,
            preempted, stored,
        )  # fmt: skip

    # ------------------------------------------------------------------ internals

    def _jittered(self, duration_s: float) -> float:
        if self._jitter <= 0:
            return duration_s
        sigma = self._jitter
        return duration_s * math.exp(self._rng.gauss(-sigma * sigma / 2.0, sigma))

    def _result(
        self,
        now_s: float,
        duration_s: float,
        num_steps: int,
        num_tokens: int,
        prefill_tokens: int,
        decode_reqs: int,
        emitted: list[RequestId],
        first: list[FirstToken],
        finished: list[FinishedRequest],
        preempted: list[RequestId],
        stored: list[BlocksStored],
    ) -> StepResult:
        pool_removed = self._pool.removed
        removed: tuple[int, ...] = ()
        if pool_removed:
            removed = tuple(pool_removed)
            pool_removed.clear()
        return StepResult(
            start_s=now_s,
            duration_s=self._jittered(duration_s),
            num_steps=num_steps,
            num_scheduled_tokens=num_tokens,
            num_prefill_tokens=prefill_tokens,
            num_decode_requests=decode_reqs,
            emitted=tuple(emitted),
            first_tokens=tuple(first),
            finished=tuple(finished),
            preempted=tuple(preempted),
            stored=tuple(stored),
            removed=removed,
        )

    def _apply_decode_run(self, now_s: float, sched: list[Seq], k: int, duration_s: float) -> StepResult:
        """`k` decode steps of `sched` as one result, with the block pool's calls in the order `k`
        single steps make them (so its LRU and evictions, and the prefix hits of later requests,
        are the same): in each step every new block is allocated, in `sched` order, then in `sched`
        order each request's filled block is cached and, at its last token, the request finished.
        Only the steps where a request crosses a block boundary or finishes call the pool."""
        bs = self.block_size
        pool = self._pool
        stored: list[BlocksStored] = []
        finished: list[FinishedRequest] = []
        ctx_r = len(sched)
        # (step, phase, position, what): phase 0 allocates a block; in phase 1 a request caches a
        # filled block (what 0), then finishes (what 1).
        events: list[tuple[int, int, int, int]] = []
        start = [seq.computed for seq in sched]
        for i, seq in enumerate(sched):
            c0, held = start[i], seq.n_cached_blocks + seq.n_private
            # Most requests cross no block boundary in a short run: no events to build.
            first_alloc = held * bs - c0 + 1
            if first_alloc <= k:
                events += ((j, 0, i, 0) for j in range(first_alloc, k + 1, bs))
            first_full = (-c0) % bs or bs
            if first_full <= k:
                events += ((j, 1, i, 0) for j in range(first_full, k + 1, bs))
            if seq.max_output - seq.generated <= k:
                events.append((k, 1, i, 1))
        events.sort()
        for j, phase, i, what in events:
            seq = sched[i]
            if phase == 0:
                pool.allocate(1)
                seq.n_private += 1
                continue
            done = j - (seq.computed - start[i])
            seq.computed += done
            seq.generated += done
            seq.num_tokens += done
            if what == 0:
                self._promote(seq, stored)
            else:
                finished.append(self._finish(seq))
        for i, seq in enumerate(sched):
            done = k - (seq.computed - start[i])
            seq.computed += done
            seq.generated += done
            seq.num_tokens += done
        self._generation_total += k * ctx_r
        if finished:
            self._running = [s for s in self._running if s.running]
        emitted = [s.request_id for s in sched]
        return self._result(now_s, duration_s, k, k * ctx_r, 0, ctx_r, emitted, [], finished, [], stored)

    def _promote(self, seq: Seq, stored: list[BlocksStored]) -> None:
        """Cache the request's blocks that became full; record runs of new hashes."""
        full = min(seq.computed // self.block_size, len(seq.hashes))
        start = seq.n_cached_blocks
        if full <= start:
            return
        pool = self._pool
        hashes = seq.hashes
        run_start = -1
        for i in range(start, full):
            if pool.store(hashes[i]):
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                stored.append(self._stored(seq, run_start, i))
                run_start = -1
        if run_start >= 0:
            stored.append(self._stored(seq, run_start, full))
        seq.n_private -= full - start
        seq.n_cached_blocks = full

    @staticmethod
    def _stored(seq: Seq, start: int, stop: int) -> BlocksStored:
        parent = seq.hashes[start - 1] if start > 0 else None
        return BlocksStored(seq.request_id, start, tuple(seq.hashes[start:stop]), parent)

    def _free(self, seq: Seq) -> None:
        self._pool.release(seq.hashes, seq.n_cached_blocks, seq.n_private)
        seq.n_cached_blocks = 0
        seq.n_private = 0
        seq.running = False

    def _preempt(self, seq: Seq) -> None:
        """Recompute preemption: free everything, restart from the front of the waiting queue."""
        self._free(seq)
        seq.computed = 0
        seq.external = 0
        seq.preemptions += 1
        self._preemptions_total += 1
        self._waiting.appendleft(seq)
        self._waiting_tokens += seq.num_tokens

    def _finish(self, seq: Seq) -> FinishedRequest:
        self._free(seq)
        del self._seqs[seq.request_id]
        self._finished_total += 1
        return FinishedRequest(
            request_id=seq.request_id,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=max(0, seq.num_cached_tokens),
            num_output_tokens=seq.generated,
            num_preemptions=seq.preemptions,
        )

    def check_invariants(self) -> None:
        """Assert block accounting and queue consistency (tests; scans everything)."""
        private = sum(s.n_private for s in self._running)
        self._pool.check_invariants(private)
        for s in self._running:
            assert s.running and s.n_private >= 0
            assert s.n_cached_blocks + s.n_private >= -(-s.computed // self.block_size)
        for s in self._waiting:
            assert not s.running and s.n_private == 0 and s.n_cached_blocks == 0
        assert self._waiting_tokens == sum(s.num_tokens for s in self._waiting)
        assert len(self._seqs) == len(self._running) + len(self._waiting)
