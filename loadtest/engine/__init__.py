"""Engine model: a clock-free, I/O-free model of one vLLM V1 engine (prefix cache + scheduler).

Used by the emulated worker (real time) and the simulator (virtual time). The caller owns the clock.

Building blocks
---------------
- `profile.load_profile(name_or_path) -> StepProfile`: step-time constants, KV pool size and
  scheduler limits from `loadtest/profiles/<name>.yaml` (`known_profiles()` lists them; default
  `DEFAULT_PROFILE`). `StepProfile.step_time_s(...)` is the step model;
  `StepProfile.isolated_prefill_s(new_tokens, cached_tokens)` is an idle engine's TTFT (compute).
- `EngineRequest(request_id, num_prompt_tokens, max_output_tokens, block_hashes)`: token counts plus
  the chained engine hashes of the sequence's full blocks (prompt first, optionally output). Either
  build it from token ids with `hashing.request_from_tokens(id, prompt_ids, max_out, block_size,
  cache_salt=..., output_token_ids=..., seed=...)` (salt mixed into block 0), or pass precomputed
  hashes directly (e.g. a trace's hash id expanded to its engine blocks) with no text at all.
  Equal hashes must mean equal prefixes (chain them); the block size is the engine's.
- `Engine(profile, EngineConfig(kv_blocks=, block_size_tokens=, max_num_batched_tokens=,
  max_num_seqs=, max_waiting_requests=, jitter_frac=, seed=))`.

Driving protocol
----------------
    engine.submit(req)                 # FCFS queue; raises EngineRejected if it can never run
    res = engine.step(now_s)           # None when idle; else one step starting at now_s,
                                       # already applied, visible at res.end_s
    engine.step(now_s, until_s=t)      # may coalesce pure-decode steps that start before t
                                       # (use the next known arrival; res.num_steps says how many)
    engine.abort(request_id)           # e.g. client disconnect; frees its blocks
    engine.stats()                     # EngineStats: running, waiting, KV usage, cache counters
    engine.reset_prefix_cache()        # AllBlocksCleared, if no cached block is in use

KV transfer (P/D disaggregation), see `transfer`:

    profile.kv_transfer_s(n)           # modelled time to move n tokens' KV between engines
    engine.prefix_hit_tokens(hashes, n)    # what a decode engine already holds (pull the rest)
    engine.install_blocks(owner, hashes)   # received full blocks enter the prefix cache
    engine.submit(EngineRequest(..., num_external_tokens=n))   # starts with n - 1 computed
    engine.hold_blocks(id, hashes) / engine.release_hold(id)   # prefill side: pin until read

A caller loop: submit arrivals; when idle, step at the arrival time; otherwise step again at the
previous `res.end_s` (arrivals during a step join the next one, as in vLLM). `StepResult` lists the
requests that produced a token (`emitted`), got their first token (`first_tokens`, with
`num_cached_tokens`), finished (`finished`, releasing blocks), were preempted (`preempted`), and
the blocks stored (`stored`: `BlocksStored` runs with request id, first block index, hashes and
parent) and evicted (`removed`) for KV events.

Model (vLLM V1 scheduler semantics)
-----------------------------------
- Prefix cache: full blocks only, a hit is capped at `num_tokens - 1` tokens; blocks referenced by
  running requests are pinned; unreferenced cached blocks are evicted LRU (a request's tail first).
  Output blocks are cached too when their hashes are given. `cached_tokens` is fixed at first
  scheduling. Counters count prompt tokens (queries) and hit tokens at first scheduling.
- Each step: running requests first (decode = 1 token, prefill = chunk up to the remaining
  budget `max_num_batched_tokens`); when a running request cannot get blocks the last running
  request is preempted (recompute: blocks freed, back to the front of the queue). Then waiting
  requests FCFS while the budget, `max_num_seqs` and free blocks allow; the first one that does
  not fit stops admission; nothing is admitted in a step that preempted.
- Step time: `profile.step_time_s(scheduled tokens, requests, decode context tokens, attention
  pairs)`, times a lognormal jitter factor if `jitter_frac` > 0. Request ingestion/HTTP time is
  not modelled here (the emulator has the real thing).

Cost: work per step is proportional to the scheduled batch plus the blocks it touches (lookups,
stores, evictions); nothing scans the whole cache and there are no per-token Python loops.
"""

from loadtest.engine.engine import Engine
from loadtest.engine.hashing import block_hashes, request_from_tokens
from loadtest.engine.profile import DEFAULT_PROFILE, ProfileError, StepProfile, known_profiles, load_profile
from loadtest.engine.sequence import EngineConfig
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

__all__ = [
    "DEFAULT_PROFILE",
    "BlocksStored",
    "Engine",
    "EngineConfig",
    "EngineQueueFull",
    "EngineRejected",
    "EngineRequest",
    "EngineStats",
    "FinishedRequest",
    "FirstToken",
    "InstalledBlocks",
    "ProfileError",
    "RequestId",
    "StepProfile",
    "StepResult",
    "block_hashes",
    "known_profiles",
    "load_profile",
    "request_from_tokens",
]
