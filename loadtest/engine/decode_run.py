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
    starts at or after `until_s`, and the blocks it allocates fit in `available_blocks`. The step
    loop finds the time limit; the blocks are checked only when the run grows past the length last
    checked, at twice the length so far, and searched below that length once they do not fit. So a
    short run (a closed loop's next arrival is a think time away) checks them at most once, and a
    long one O(log) times, never running the loop far past the block limit.
    """
    k_max = min(s.max_output - s.generated for s in sched)
    if k_max <= 1:
        return 1, first_s
    step_s = d_s_per_context_token * len(sched)
    total_s = first_s
    k = 1
    limit = k_max  # becomes the block limit once the blocks are found to bind
    fits = 1  # every run up to this many steps fits the blocks (one step needs none)
    # Step j reads r more context tokens than step j-1; stop before a step that would start
    # at or after until_s (a request arriving then joins that step in a real engine).
    while k < limit and now_s + total_s < until_s:
        if k >= fits:
            target = min(limit, 2 * k + 2)
            if _extra_blocks(sched, target, block_size) <= available_blocks:
                fits = target
            else:
                # The largest run in [fits, target) whose blocks fit (extra blocks never shrink
                # as the run grows).
                lo, hi = fits, target - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if _extra_blocks(sched, mid, block_size) <= available_blocks:
                        lo = mid
                    else:
                        hi = mid - 1
                limit = fits = lo
                if k >= limit:
                    break
        total_s += first_s + step_s * k
        k += 1
    return k, total_s


def _extra_blocks(sched: list[Seq], k: int, block_size: int) -> int:
    """Blocks `k` decode steps of `sched` allocate beyond what its requests hold now."""
    extra = 0
    for s in sched:
        need = (s.computed + k + block_size - 1) // block_size - s.n_cached_blocks - s.n_private
        if need > 0:
            extra += need
    return extra
