"""How many pure-decode steps the engine may coalesce into one `StepResult` (`Engine.step`'s
`until_s`): as many as no request finishes, no block allocation fails and no step starts at or
after the caller's next arrival."""

from __future__ import annotations

import numpy as np

from loadtest.engine.sequence import Seq


def decode_run_length(
    sched: list[Seq],
    first_s: float,
    now_s: float,
    until_s: float,
    block_size: int,
    available_blocks: int,
    d_s_per_context_token: float,
) -> tuple[int, float]:
    """Steps to coalesce (≥1) for the running decodes `sched`, and their total duration.

    `first_s` is the first step's duration; each later step reads one more context token per
    request, costing `d_s_per_context_token` each.
    """
    k_max = min(s.max_output - s.generated for s in sched)
    if k_max <= 1:
        return 1, first_s
    bs = block_size
    comp = np.fromiter((s.computed for s in sched), dtype=np.int64, count=len(sched))
    held = np.fromiter((s.n_cached_blocks + s.n_private for s in sched), dtype=np.int64, count=len(sched))

    def extra_blocks(k: int) -> int:
        return int(np.maximum(0, (comp + k + bs - 1) // bs - held).sum())

    lo, hi = 1, k_max  # largest k with extra_blocks(k) <= available; extra_blocks(1) == 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if extra_blocks(mid) <= available_blocks:
            lo = mid
        else:
            hi = mid - 1
    r = len(sched)
    total_s = first_s
    k = 1
    # Step j reads r more context tokens than step j-1; stop before a step that would start
    # at or after until_s (a request arriving then joins that step in a real engine).
    while k < lo and now_s + total_s < until_s:
        total_s += first_s + d_s_per_context_token * r * k
        k += 1
    return k, total_s
