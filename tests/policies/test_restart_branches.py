"""A worker that restarts (or joins) starts with the pool's mean recent work: new sessions spread
over the pool after a restart instead of all going to the restarted worker until the work routed
there catches up with the others'."""

from __future__ import annotations

from collections import Counter

from policies.base import Observation, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from tests.policies.factories import req

W = [WorkerView(WorkerId(f"w{i}")) for i in range(3)]


def _serve(policy: CostPolicy, rid: str, first_block: int, n_blocks: int, now_s: float) -> WorkerId:
    r = req(rid, range(first_block, first_block + n_blocks))
    d = policy.select(r, W, now_s)
    assert d is not None
    policy.on_dispatch(r, d, now_s)
    policy.on_complete(
        Observation(r, d.worker, ttft_s=0.1, prompt_tokens=r.n_prompt_tokens, cached_tokens=0), now_s
    )
    return d.worker


def test_new_sessions_spread_after_a_restart() -> None:
    policy = CostPolicy(seed=0)
    # Long sessions spread over the three workers: each has routed a lot of prefill work.
    for i in range(30):
        _serve(policy, f"long{i}", 100_000 * (i + 1), 2000, now_s=i * 0.5)
    before = [policy.recent_work_s(w.worker_id, 15.0) for w in W]
    assert min(before) > 0
    policy.worker_reset("p", WorkerId("w0"))
    after = policy.recent_work_s(WorkerId("w0"), 15.0)
    assert min(before[1:]) <= after <= max(before[1:])
    # Short new sessions then: the restarted worker takes its share, not all of them.
    chosen = Counter(
        _serve(policy, f"short{i}", 10_000_000 * (i + 1), 8, now_s=15.0 + i * 0.01) for i in range(30)
    )
    assert chosen[WorkerId("w0")] < 20 and len(chosen) == 3


def test_a_worker_alone_in_its_pool_starts_from_nothing() -> None:
    policy = CostPolicy(seed=0)
    only = [WorkerView(WorkerId("solo"))]
    r = req("r", range(200), pool="q")
    d = policy.select(r, only, 0.0)
    assert d is not None
    policy.on_dispatch(r, d, 0.0)
    assert policy.recent_work_s(WorkerId("solo"), 0.0) > 0
    policy.worker_reset("q", WorkerId("solo"))
    assert policy.recent_work_s(WorkerId("solo"), 0.0) == 0.0
