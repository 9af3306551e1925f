"""`decode_run_length` against a step-by-step reference: the same run length and the same float
sum, whichever of the three limits (a finish, the next arrival, the free blocks) binds."""

from __future__ import annotations

import math
import random

from loadtest.engine.decode_run import decode_run_length
from loadtest.engine.sequence import Seq
from loadtest.engine.types import EngineRequest


def _reference(
    sched: list[Seq], first_s: float, now_s: float, until_s: float, bs: int, available: int, d_s: float
) -> tuple[int, float]:
    """Grow the run one step at a time while the next step finishes nobody, starts before
    `until_s` and its blocks fit."""

    def extra(k: int) -> int:
        return sum(max(0, -(-(s.computed + k) // bs) - s.n_cached_blocks - s.n_private) for s in sched)

    k_max = min(s.max_output - s.generated for s in sched)
    k, total_s = 1, first_s
    while k < k_max and now_s + total_s < until_s and extra(k + 1) <= available:
        total_s += first_s + d_s * len(sched) * k
        k += 1
    return k, total_s


def _decoding(rng: random.Random, i: int, bs: int) -> Seq:
    seq = Seq(EngineRequest(f"r{i}", rng.randint(1, 300), rng.randint(2, 400)))
    seq.computed = seq.num_prompt
    seq.num_tokens = seq.num_prompt + 1
    seq.generated = rng.randint(1, seq.max_output - 1)
    held = -(-(seq.computed + 1) // bs) + rng.randint(0, 2)
    seq.n_cached_blocks = held // 2
    seq.n_private = held - held // 2
    return seq


def test_decode_run_length_matches_step_by_step() -> None:
    rng = random.Random(7)
    for i in range(3000):
        bs = rng.choice((1, 2, 4, 16))
        sched = [_decoding(rng, j, bs) for j in range(rng.randint(1, 12))]
        first_s = rng.uniform(0.005, 0.02)
        now_s = rng.uniform(0, 1000)
        until_s = now_s + rng.choice((rng.uniform(0, 0.05), rng.uniform(0, 5), math.inf))
        args = (sched, first_s, now_s, until_s, bs, rng.randint(0, 60), rng.uniform(0, 1e-6))
        assert decode_run_length(*args) == _reference(*args), i
