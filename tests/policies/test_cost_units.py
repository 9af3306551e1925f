"""`cost` in approximate mode (request tokens = characters / 4) decides as with token-exact keys:
every count it weighs against the engine's is converted at the learned ratio."""

from __future__ import annotations

import dataclasses

from policies.base import Observation, RouteRequest, WorkerId, WorkerView
from policies.cost_model import CostModel
from policies.cost_params import CostModelParams
from policies.cost_policy import CostPolicy
from tests.policies.factories import req


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
    cost.note_complete("r", None, prompt_tokens=400, cached_tokens=None, request_tokens=100)
    assert abs(cost.engine_tokens_per_request_token - 4.0) < 1e-9
    cost.note_complete("r2", None, prompt_tokens=200, cached_tokens=None, request_tokens=100)
    assert 3.0 < cost.engine_tokens_per_request_token < 4.0  # later ones move it gradually


def test_a_completion_is_a_sample_folded_and_the_same_sample_folds_alike_elsewhere() -> None:
    here, there = CostModel(CostModelParams()), CostModel(CostModelParams())
    here.note_dispatch("r", 0.001, 0)
    sample = here.note_complete("r", 0.3, prompt_tokens=4000, cached_tokens=0, request_tokens=1000)
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
    assert here.note_complete("unknown", None, prompt_tokens=None, cached_tokens=None) is None
