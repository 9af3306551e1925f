"""`CandidateCache` with backlogs that drain with time (`prefill_progress` > 0) equals a fresh pass.

A pool's views change a few at a time from one decision to the next (counters, health, in-flight
caps reached and left, backlogs restarted or emptied), now and then all at once, reordered or
with a worker more or less, while time advances and completions move the model's scale, mean
prompt and units. After every decision the cache's columns must equal `candidates(...)` done
afresh, whose drained backlogs must equal the model's own `prefill_remaining` of each view.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from policies.base import WorkerId, WorkerView
from policies.cost_model import CalibrationSample, CostModel
from policies.cost_params import CostModelParams
from policies.cost_scan import CandidateCache, candidates
from tests.policies.test_cost_scan import CountingCache


def _view(rng: random.Random, worker: WorkerId, now_s: float) -> WorkerView:
    tokens = rng.choice((0, 0, rng.randint(1, 2_000), rng.randint(1, 60_000)))
    # A start mostly in the past (drained in part or wholly), now and then unknown or just after now.
    started = rng.choice((None, now_s - rng.uniform(0.0, 4.0), now_s - rng.uniform(0.0, 0.2), now_s + 0.01))
    cap = rng.choice((None, None, 4))
    return WorkerView(
        worker,
        healthy=rng.random() > 0.05,
        in_flight_requests=rng.randint(0, 5),
        in_flight_prefill_tokens=tokens,
        in_flight_prefill_pairs=tokens * rng.randint(0, tokens) // 2,
        in_flight_decode_tokens=rng.randint(0, 100_000),
        max_in_flight=cap,
        num_requests_waiting=rng.choice((None, rng.randint(0, 3))),
        num_requests_running=rng.randint(0, 6),
        prefill_started_s=started if tokens or rng.random() < 0.2 else None,
    )


def _step(rng: random.Random, views: list[WorkerView], n: int, step: int, now_s: float) -> list[WorkerView]:
    """The next decision's views: mostly the same objects, a few replaced; now and then many new,
    reordered, or a worker more or less (the cache then rebuilds)."""
    views = list(views)
    for _ in range(rng.choice((0, 1, 1, 2, 3, 5, n // 3 + 1))):
        i = rng.randrange(len(views))
        old = views[i]
        change = rng.random()
        if change < 0.15:
            views[i] = dataclasses.replace(old)  # a new object, equal to the one it replaces
        elif change < 0.35:
            # The backlog restarts (a first token), empties, or its start becomes unknown.
            started = rng.choice((None, now_s, now_s - rng.uniform(0.0, 1.0)))
            tokens = old.in_flight_prefill_tokens if started is not None else rng.choice((0, 500))
            views[i] = dataclasses.replace(old, prefill_started_s=started, in_flight_prefill_tokens=tokens)
        elif change < 0.5:
            # A dispatch or a completion moves it across its in-flight cap.
            inflight = rng.choice((3, 4)) if old.max_in_flight else rng.randint(0, 5)
            views[i] = dataclasses.replace(
                old, in_flight_requests=inflight, max_in_flight=old.max_in_flight or 4
            )
        else:
            views[i] = _view(rng, old.worker_id, now_s)
    if step % 29 == 7:
        rng.shuffle(views)
    if step % 31 == 11:
        if len(views) > 1 and rng.random() < 0.5:
            views.pop(rng.randrange(len(views)))
        else:
            views.append(_view(rng, WorkerId(f"w{n}-{step}"), now_s))
    return views


def _complete(rng: random.Random, model: CostModel) -> None:
    """A completion moves the model's mean prompt and scale (and, now and then, its units)."""
    prompt = rng.randint(100, 40_000)
    estimate = prompt if rng.random() < 0.8 else int(prompt * rng.uniform(0.5, 1.5))
    model.fold(CalibrationSample(prompt, estimate, rng.uniform(0.3, 3.0)))


@pytest.mark.parametrize("progress", [1.0, 0.5])
@pytest.mark.parametrize("n", [3, 40, 130, 300])
def test_drained_columns_equal_a_fresh_pass(n: int, progress: float) -> None:
    rng = random.Random(n * 10 + int(progress * 2))
    model = CostModel(CostModelParams(prefill_progress=progress))
    cache = CountingCache()
    now = 100.0
    views = [_view(rng, WorkerId(f"w{i}"), now) for i in range(n)]
    decisions = partly = 0
    for step in range(500):
        now += rng.choice((0.0, 0.001, 0.05, 0.3))
        views = _step(rng, views, n, step, now)
        if rng.random() < 0.6:
            _complete(rng, model)
        shares = {v.worker_id: rng.random() for v in views if rng.random() < 0.3} if step % 3 == 0 else {}
        # Now and then a call without the drain: the cache stops keeping it, then takes it again.
        remaining = None if step % 17 == 16 else model.remaining_at(now)
        kept = cache.candidates(views, shares, remaining)
        fresh = candidates(views, shares, remaining)
        assert kept == fresh, f"step {step}"
        if not shares:
            assert kept.backlogs is kept.pending  # integer keys for the heap (`by_backlog`)
        if remaining is not None:
            assert fresh.pending == [model.prefill_remaining(w, now) for w in fresh.views], f"step {step}"
            decisions += 1
            partly += sum(
                0 < p < w.in_flight_prefill_tokens for p, w in zip(fresh.pending, fresh.views, strict=True)
            )
    assert decisions > 400 and partly > 50  # many backlogs drained in part
    if n >= 40:
        assert cache.rebuilds < 250  # most decisions took in a few changed views


def test_every_candidate_draining_and_none() -> None:
    # Every worker busy since a known start: the drained list is handed out as is; then none.
    model = CostModel(CostModelParams(prefill_progress=1.0))
    views = [
        WorkerView(
            WorkerId(f"w{i}"),
            in_flight_requests=1,
            in_flight_prefill_tokens=1_000 * (i + 1),
            prefill_started_s=0.0,
        )
        for i in range(128)
    ]
    cache = CandidateCache()
    for now in (0.0, 0.5, 1.0, 30.0):
        assert cache.candidates(views, {}, model.remaining_at(now)) == candidates(
            views, {}, model.remaining_at(now)
        )
    assert cache.candidates(views, {}, model.remaining_at(30.0)).pending == [0] * 128
    idle = [dataclasses.replace(w, in_flight_prefill_tokens=0, prefill_started_s=None) for w in views]
    drained = cache.candidates(idle, {}, model.remaining_at(31.0))
    assert drained == candidates(idle, {}) and drained.pending == [0] * 128


def test_a_worker_crossing_its_cap_shifts_the_draining_positions() -> None:
    # A saturated pool of busy workers: each step moves one across its cap, so the candidates
    # after it move by one; their backlogs must still drain by their own starts.
    rng = random.Random(3)
    model = CostModel(CostModelParams(prefill_progress=1.0))
    views = [
        WorkerView(
            WorkerId(f"w{i}"),
            in_flight_requests=4,
            max_in_flight=4,
            in_flight_prefill_tokens=rng.choice((0, rng.randint(1, 50_000))),
            prefill_started_s=rng.uniform(0.0, 2.0),
        )
        for i in range(120)
    ]
    cache = CountingCache()
    for k in range(400):
        i = rng.randrange(len(views))
        inflight = min(4, max(0, views[i].in_flight_requests + rng.choice((-1, 1))))
        views[i] = dataclasses.replace(views[i], in_flight_requests=inflight)
        now = 2.0 + k * 0.01
        remaining = model.remaining_at(now)
        assert cache.candidates(views, {}, remaining) == candidates(views, {}, remaining), f"step {k}"
    assert cache.rebuilds == 1
