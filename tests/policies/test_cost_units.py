"""`cost` in approximate mode (request tokens = characters / 4) decides as with token-exact keys:
every count it weighs against the engine's is converted at the learned ratio."""

from __future__ import annotations

import dataclasses

from policies.base import Observation, Outcome, RouteRequest, WorkerId, WorkerView
from policies.cost_model import CostModel
from policies.cost_params import CostModelParams
from policies.cost_policy import CostPolicy
from tests.policies.factories import req

W = WorkerId("w1")


def _shrunk(r: RouteRequest, unit: int) -> RouteRequest:
    """`r` as the approximate normalizer estimates it: `unit` engine tokens per request token."""
    return dataclasses.replace(r, n_prompt_tokens=r.n_prompt_tokens // unit, block_size_tokens=16 // unit)


def _decide(unit: int, queued: int = 1) -> str:
    """A 2k-token prefix held by w0, which is prefilling `queued` other prompts; the others are
    idle but for one prompt each in prefill."""
    p = CostPolicy(seed=1)
    warm = _shrunk(req("warm", range(128)), unit)
    d = p.select(warm, [WorkerView(WorkerId("w0"))], 0.0)
    assert d is not None
    p.on_dispatch(warm, d, 0.0)
    engine_tokens = warm.n_prompt_tokens * unit
    p.on_complete(Observation(warm, d.worker, ttft_s=None, prompt_tokens=engine_tokens), 0.0)
    r = _shrunk(req("r", range(136)), unit)
    n = r.n_prompt_tokens
    busy = WorkerView(WorkerId("w0"), in_flight_requests=queued, in_flight_prefill_tokens=queued * n)
    views = [busy] + [
        WorkerView(WorkerId(f"w{i}"), in_flight_requests=1, in_flight_prefill_tokens=n) for i in (1, 2, 3)
    ]
    chosen = p.select(r, views, 1.0)
    assert chosen is not None
    return f"{chosen.worker}/{chosen.reason}"


def test_a_holder_busy_with_one_prefill_keeps_its_prefix_in_both_units() -> None:
    assert _decide(1) == _decide(4) == "w0/hit"


def test_both_units_weigh_a_queue_alike() -> None:
    for queued in (2, 3, 4, 6):
        assert _decide(1, queued) == _decide(4, queued)


def test_work_routed_to_a_worker_is_counted_in_engine_tokens() -> None:
    """The branch charge (prefill seconds recently routed to a worker) is the same in both units."""
    recent = []
    for unit in (1, 4):
        p = CostPolicy(seed=1)
        warm = _shrunk(req("warm", range(128)), unit)
        d = p.select(warm, [WorkerView(WorkerId("w0"))], 0.0)
        assert d is not None
        p.on_dispatch(warm, d, 0.0)
        p.on_complete(
            Observation(warm, d.worker, ttft_s=None, prompt_tokens=warm.n_prompt_tokens * unit), 0.0
        )
        r = _shrunk(req("r", range(300)), unit)
        d = p.select(r, [WorkerView(WorkerId("w1"))], 1.0)
        assert d is not None
        p.on_dispatch(r, d, 1.0)
        recent.append(p.recent_work_s(WorkerId("w1"), 1.0))
    assert (
        recent[0] > 0 and abs(recent[1] - recent[0]) < 1e-3 * recent[0]
    )  # 4,801 engine tokens against 4,800


def test_the_first_sample_sets_the_engine_unit() -> None:
    cost = CostModel(CostModelParams())
    cost.note_complete("r", W, None, prompt_tokens=400, cached_tokens=None, request_tokens=100)
    assert abs(cost.engine_tokens_per_request_token - 4.0) < 1e-9
    cost.note_complete("r2", W, None, prompt_tokens=200, cached_tokens=None, request_tokens=100)
    assert 3.0 < cost.engine_tokens_per_request_token < 4.0  # later ones move it gradually


def test_a_completion_is_a_sample_folded_and_the_same_sample_folds_alike_elsewhere() -> None:
    here, there = CostModel(CostModelParams()), CostModel(CostModelParams())
    here.note_dispatch("r", W, 0.001, 0)
    sample = here.note_complete("r", W, 0.3, prompt_tokens=4000, cached_tokens=0, request_tokens=1000)
    assert sample is not None and sample.prompt_tokens == 4000 and sample.request_tokens == 1000
    assert sample.scale_ratio > 1.0
    there.fold(sample)
    state = (
        here.scale,
        here.engine_tokens_per_request_token,
        here.mean_prompt_tokens,
        here.calibration_samples,
    )
    assert state == (there.scale, there.engine_tokens_per_request_token, there.mean_prompt_tokens, 1)
    # Nothing measured, nothing to share.
    assert here.note_complete("unknown", W, None, prompt_tokens=None, cached_tokens=None) is None


def test_a_record_calibrates_only_against_the_worker_it_predicts() -> None:
    cost = CostModel(CostModelParams())
    other = WorkerId("w2")
    cost.note_dispatch("r", W, 0.001, 0)
    cost.forget("r", other)  # another leg of the request failed: the record is about W
    assert cost.pending_requests == 1
    measured = cost.note_complete("r", other, 0.3, prompt_tokens=4000, cached_tokens=0)
    assert measured is not None and measured.scale_ratio == 0.0  # the unit only: not W's queue
    assert cost.pending_requests == 1
    sample = cost.note_complete("r", W, 0.3, prompt_tokens=4000, cached_tokens=0)
    assert sample is not None and sample.scale_ratio > 1.0 and cost.pending_requests == 0


def test_a_failed_leg_elsewhere_leaves_the_served_leg_its_calibration() -> None:
    """An SGLang pair's legs run at once on two workers: the one that fails must not take the
    record of the one the policy predicted."""
    policy = CostPolicy(seed=0)
    served, failed = WorkerId("w1"), WorkerId("w2")
    r = req("r", range(250))
    d = policy.select(r, [WorkerView(served)], 0.0)
    assert d is not None and d.worker == served
    policy.on_dispatch(r, d, 0.0)
    cost = policy._pool(r).cost
    policy.on_complete(Observation(r, failed, outcome=Outcome.WORKER_FAILED), 0.1)
    before = cost.calibration_samples
    policy.on_complete(
        Observation(r, served, ttft_s=2.0, prompt_tokens=r.n_prompt_tokens, cached_tokens=0), 2.0
    )
    assert cost.calibration_samples == before + 1 and cost.scale > 1.0
