"""`policies.cost_model`: the prefill model and its calibration, the queue term (the backlog's tokens
and attention), and the scorer's inlined copies of it, kept equal to the model."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import WorkerId, WorkerView, prefill_pairs
from policies.cost_model import CostModel
from policies.cost_params import CostModelParams, profile
from policies.cost_policy import CostPolicy
from policies.cost_scorer import Scorer
from tests.policies.factories import req


def test_cost_model_shape_and_calibration() -> None:
    model = CostModel(CostModelParams())
    # Attention makes a 32k prefill more than 16x a 2k one; the back half of a prompt costs more
    # than the front half, so a match saves the front half's compute but not a step.
    assert model.prefill_s(32_768) > 16 * model.prefill_s(2048)
    assert model.saved_s(4096, 2048) == pytest.approx(model.prefill_s(2048) - model.params.step_s)
    assert model.prefill_s(2048, 2048) > model.prefill_s(2048, 0)
    assert model.saved_s(4096, 0) == 0.0
    before = model.prefill_s(4000)
    for i in range(200):
        model.note_dispatch(f"r{i}", WorkerId("a"), 0.0, 0)
        model.note_complete(f"r{i}", WorkerId("a"), 0.01 + 2.0 * before, 4000, 0)
    assert model.prefill_s(4000) == pytest.approx(2.0 * before, rel=0.05)
    assert model.calibration_samples == 200


def test_queue_cost_grows_with_backlog_and_scraped_waiting() -> None:
    model = CostModel(CostModelParams())
    idle = WorkerView(WorkerId("a"))
    busy = WorkerView(WorkerId("a"), in_flight_requests=2, in_flight_prefill_tokens=8000)
    crowded = WorkerView(
        WorkerId("a"),
        in_flight_requests=2,
        in_flight_prefill_tokens=8000,
        num_requests_waiting=8,
        num_requests_running=0,
    )
    assert model.queue_s(idle) == 0.0
    assert model.queue_s(busy) > 0.1
    assert model.queue_s(crowded) == pytest.approx(4 * model.queue_s(busy), rel=0.05)


def test_unknown_profile_lists_known() -> None:
    with pytest.raises(ValueError, match="llama3-8b-h100"):
        profile("nope")


def _pending(worker: str, prompts: int, tokens: int, pairs: int) -> WorkerView:
    """A worker with `prompts` prompts pending prefill: `tokens` tokens, `pairs` attention pairs."""
    return WorkerView(
        WorkerId(worker),
        in_flight_requests=prompts,
        in_flight_prefill_tokens=tokens,
        in_flight_prefill_pairs=pairs,
    )


def test_a_long_prompt_pending_costs_more_than_as_many_tokens_in_short_ones() -> None:
    # Attention is quadratic per prompt: one 120k-token miss queued computes 120k·60k pairs, twelve
    # 10k-token ones 12·10k·5k. The queue prices each backlog at its own attention.
    model = CostModel(CostModelParams())
    one = _pending("a", 1, 120_000, prefill_pairs(120_000, 0))
    twelve = _pending("b", 12, 120_000, 12 * prefill_pairs(10_000, 0))
    assert model.queue_s(one) == pytest.approx(model.prefill_s(120_000), rel=0.01)
    assert model.queue_s(twelve) == pytest.approx(12 * model.prefill_s(10_000), rel=0.02)
    assert model.queue_s(one) > 3 * model.queue_s(twelve)
    # A prompt mostly cached computes only its new tokens' attention, over the cached ones too;
    # a backlog's attention is never counted below the mean prompt's (1,024 tokens before any
    # completion): each backlog token at least 512 pairs.
    hit = _pending("c", 1, 10_000, prefill_pairs(10_000, 8_000))
    floor = dataclasses.replace(hit, in_flight_prefill_pairs=0)
    above = model.params.attention_s_per_pair * (2_000 * 9_000 - 10_000 * 512)
    assert model.queue_s(hit) == pytest.approx(model.queue_s(floor) + above)
    assert model.queue_s(floor) == model.queue_s(dataclasses.replace(hit, in_flight_prefill_pairs=10_000))


def test_prompts_the_gateway_did_not_send_are_priced_at_the_mean_prompts_attention() -> None:
    model = CostModel(CostModelParams())
    miss = _pending("a", 1, 190_000, prefill_pairs(190_000, 0))
    # The worker reports one request more than this gateway sent: it brings as many tokens as the
    # gateway's own, at the mean prompt's attention (about 4.3 s), not a second 28 s miss.
    crowded = dataclasses.replace(miss, num_requests_waiting=1, num_requests_running=1)
    p = model.params
    extra_s = 190_000 * (p.prefill_s_per_token + p.attention_s_per_pair * model.mean_prompt_tokens / 2)
    assert model.queue_s(crowded) - model.queue_s(miss) == pytest.approx(extra_s, rel=0.05)


def test_a_miss_avoids_the_worker_whose_queue_is_one_long_prompt() -> None:
    # Both workers have 120k prompt tokens pending; on w0 they are one long prompt (about 12 s of
    # prefill), on w1 twelve short ones (under 4 s).
    p = CostPolicy(seed=1)
    views = [
        _pending("w0", 1, 120_000, prefill_pairs(120_000, 0)),
        _pending("w1", 12, 120_000, 12 * prefill_pairs(10_000, 0)),
    ]
    d = p.select(req("r", range(64)), views, 0.0)
    assert d is not None and d.worker == "w1"


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 20),
    st.integers(0, 50_000),
    st.integers(0, 300_000),
    st.one_of(st.none(), st.integers(0, 30)),
    st.one_of(st.none(), st.integers(0, 30)),
    st.integers(1, 40),
    st.floats(0.0, 1.0),
)
def test_inlined_queue_cost_equals_the_cost_model(
    inflight: int,
    prefill: int,
    decode: int,
    waiting: int | None,
    running: int | None,
    blocks: int,
    attention: float,
) -> None:
    p = CostPolicy(seed=1)
    view = WorkerView(
        WorkerId("w0"),
        in_flight_requests=inflight,
        in_flight_prefill_tokens=prefill,
        in_flight_prefill_pairs=int(attention * prefill * prefill / 2),
        in_flight_decode_tokens=decode,
        num_requests_waiting=waiting,
        num_requests_running=running,
    )
    r = req("r", range(blocks))
    d = p.select(r, [view], 0.0)
    assert d is not None
    model = p._pool(r).cost
    assert model._pending["r"].queue_s == pytest.approx(
        model.queue_s(view, r.n_prompt_tokens - d.matched_tokens)
    )


@settings(deadline=None)
@given(st.integers(1, 200_000), st.integers(0, 200_000))
def test_inlined_saved_time_equals_the_cost_model(n: int, m: int) -> None:
    p = CostPolicy(seed=1)
    r = dataclasses.replace(req("r", range(1)), n_prompt_tokens=n)
    model = CostModel(profile("llama3-8b-a100"))
    scorer = Scorer(p.tie_s, r, model, model.queue_terms(), 3.0, 0)
    assert scorer.saved(m) == pytest.approx(model.saved_s(n, m) * 3.0, rel=1e-9, abs=1e-15)
