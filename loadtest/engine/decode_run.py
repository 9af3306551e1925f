"""How many pure-decode steps the engine may coalesce into one `StepResult` (`Engine.step`'s
`until_s`): as many as no request finishes, no block allocation fails and no step starts at or
after the caller's next arrival."""

from __future__ import annotations

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

    The run is the shortest of three limits: no request finishes inside it (`k_max`), no step
    starts at or after `until_s`, and the blocks it allocates fit in `available_blocks`. The time
    limit is found first, by the step loop itself: it is usually the tightest (a closed loop's
    horizon is a think time away), and the block count is then checked once at that length; only
    when the blocks do not fit is the block limit searched below it.
    """
    k_max = min(s.max_output - s.generated for s in sched)
    if k_max <= 1:
        return 1, first_s
    step_s = d_s_per_context_token * len(sched)
    total_s = first_s
    k = 1
    # Step j reads r more context tokens than step j-1; stop before a step that would start
    # at or after until_s (a request arriving then joins that step in a real engine).
    while k < k_max and now_s + total_s < until_s:
        total_s += first_s + step_s * k
        k += 1
    if k == 1 or _extra_blocks(sched, k, block_size) <= available_blocks:
        return k, total_s
    # The blocks run out first: the largest lo < k whose blocks fit (extra blocks never shrink as
    # the run grows, and one step needs none: the scheduler allocated it).
    lo, hi = 1, k - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _extra_blocks(sched, mid, block_size) <= available_blocks:
            lo = mid
        else:
            hi = mid - 1
    total_s = first_s
    for j in range(1, lo):
        total_s += first_s + step_s * j
    return lo, total_s


def _extra_blocks(sched: list[Seq], k: int, block_size: int) -> int:
    """Blocks `k` decode steps of `sched` allocate beyond what its requests hold now."""
    extra = 0
    for s in sched:
        need = (s.computed + k + block_size - 1) // block_size - s.n_cached_blocks - s.n_private
        if need > 0:
            extra += need
    return extra
