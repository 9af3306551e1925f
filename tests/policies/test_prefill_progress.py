"""Prefill progress since dispatch: the backlog a worker still has to compute drains with time.

The gateway counts a prompt as pending, whole, until its first token. With
`CostModelParams.prefill_progress`, `CostModel.prefill_remaining` takes off what the time since the
backlog last restarted (`WorkerView.prefill_started_s`) can have computed, at the calibrated rate.
"""

from __future__ import annotations

import dataclasses

import pytest

from policies.base import RouteDecision, WorkerId, WorkerView
from policies.cost_model import CostModel
from policies.cost_params import CostModelParams
from policies.cost_policy import CostPolicy
from policies.cost_scan import candidates
from policies.peer_sync import PeerLoad, PeerLoads, with_peer_load
from policies.pools import PoolSettings
from policies.prefix_policy import SharedSettings
from tests.policies.factories import req

W0, W1 = WorkerId("w0"), WorkerId("w1")


def _busy(tokens: int, started_s: float | None, requests: int = 1) -> WorkerView:
    return WorkerView(
        W0, in_flight_requests=requests, in_flight_prefill_tokens=tokens, prefill_started_s=started_s
    )


def test_the_backlog_drains_with_the_time_since_it_restarted() -> None:
    model = CostModel(CostModelParams(prefill_progress=1.0))
    view = _busy(100_000, started_s=10.0)
    assert model.prefill_remaining(view, 10.0) == 100_000  # no time, no progress
    left = [model.prefill_remaining(view, 10.0 + t) for t in (0.5, 1.0, 2.0, 4.0)]
    assert left == sorted(left, reverse=True) and 0 < left[-1] < left[0] < 100_000
    assert model.prefill_remaining(view, 1e6) == 0  # never below zero
    # Unknown start, or the option off: the whole backlog.
    assert model.prefill_remaining(_busy(100_000, None), 20.0) == 100_000
    off = CostModel(CostModelParams(prefill_progress=0.0))
    assert off.prefill_remaining(view, 20.0) == 100_000 and off.remaining_at(20.0) is None


def test_no_more_is_drained_than_the_fastest_rate_allows() -> None:
    p = CostModelParams(prefill_progress=1.0)
    model = CostModel(p)
    model.scale = 0.5  # a faster engine than modelled drains faster, still within its rate
    fastest_s_per_token = model.scale * (p.prefill_s_per_token + p.step_s / p.max_batched_tokens)
    for tokens in (1_000, 20_000, 200_000):
        for elapsed in (0.01, 0.3, 2.0):
            drained = tokens - model.prefill_remaining(_busy(tokens, 0.0), elapsed)
            assert 0 <= drained <= elapsed / fastest_s_per_token


def test_a_long_prompt_near_its_end_is_seen_near_its_end() -> None:
    # A 103k-token prompt alone: its own attention makes it take about 9 s here.
    model = CostModel(CostModelParams(prefill_progress=1.0))
    alone_s = model.prefill_s(103_000)
    assert model.prefill_remaining(_busy(103_000, 0.0), 0.5 * alone_s) > 40_000
    assert model.prefill_remaining(_busy(103_000, 0.0), 0.98 * alone_s) < 5_000


def test_queue_s_charges_what_is_left() -> None:
    model = CostModel(CostModelParams(prefill_progress=1.0))
    view = _busy(60_000, started_s=0.0, requests=2)
    left = model.prefill_remaining(view, 1.0)
    assert 0 < left < 60_000
    rest = dataclasses.replace(view, in_flight_prefill_tokens=left, prefill_started_s=None)
    assert model.queue_s(view, 500, 1.0, now_s=1.0) == pytest.approx(model.queue_s(rest, 500))
    assert model.queue_s(view, 500, 1.0, now_s=1.0) < model.queue_s(view, 500)  # no `now_s`: whole


def test_the_scan_orders_and_bounds_by_what_is_left() -> None:
    model = CostModel(CostModelParams(prefill_progress=1.0))
    views = [
        _busy(50_000, started_s=0.0),
        WorkerView(W1, in_flight_requests=1, in_flight_prefill_tokens=20_000),
    ]
    plain = candidates(views, {})
    drained = candidates(views, {}, model.remaining_at(5.0))
    assert plain.pending == [50_000, 20_000]
    assert drained.pending == [model.prefill_remaining(views[0], 5.0), 20_000]
    assert drained.pending[0] < 20_000
    assert drained.raw_backlog == plain.raw_backlog  # the queue weight's prompts waiting stay whole


def _policy(progress: bool) -> CostPolicy:
    params = CostModelParams(prefill_progress=1.0 if progress else 0.0, calibrate=False)
    # No queue weight on saved compute: the choice is the holder's queue against the recompute.
    return CostPolicy(seed=0, work_weight=0.0, shared=SharedSettings(default_pool=PoolSettings(cost=params)))


@pytest.mark.parametrize("progress", [False, True])
def test_a_holder_almost_done_with_a_long_prefill_keeps_the_conversation(progress: bool) -> None:
    # w0 holds the conversation's 23k-token history and has been prefilling a 103k-token prompt
    # for 9 s; w1 is idle. The next turn stays only if the policy sees that prefill nearly done.
    p = _policy(progress)
    history = req("turn1", range(1_440))
    p.on_dispatch(history, RouteDecision(W0, 0.0, "miss"), 0.0)
    turn = req("turn2", range(1_500))
    views = [
        WorkerView(W0, in_flight_requests=1, in_flight_prefill_tokens=103_000, prefill_started_s=1.0),
        WorkerView(W1),
    ]
    decision = p.select(turn, views, 10.0)
    assert decision is not None
    assert (decision.worker, decision.reason) == ((W0, "hit") if progress else (W1, "spread"))


def test_peers_prefill_counts_progress_only_from_its_last_change() -> None:
    loads = PeerLoads()
    loads.note("a", [PeerLoad("p", W0, 1, 40_000, 100)], 5.0, full=False)
    loads.note("b", [PeerLoad("p", W0, 1, 10_000, 100)], 6.0, full=False)
    # A snapshot whose prefill did not change keeps its restart time; one that did, moves it.
    loads.note("a", [PeerLoad("p", W0, 1, 40_000, 90)], 7.0, full=False)
    total = loads.total("p", W0)
    assert total is not None and total.prefill_tokens == 50_000 and total.prefill_since_s == 6.0
    loads.note("a", [PeerLoad("p", W0, 2, 45_000, 90)], 8.0, full=False)
    total = loads.total("p", W0)
    assert total is not None and total.prefill_since_s == 8.0
    # Combined with this gateway's own backlog: the latest restart of the two; unknown wins.
    own = WorkerView(W0, in_flight_requests=1, in_flight_prefill_tokens=5_000, prefill_started_s=9.0)
    assert with_peer_load(own, total).prefill_started_s == 9.0
    assert with_peer_load(dataclasses.replace(own, prefill_started_s=2.0), total).prefill_started_s == 8.0
    unknown = dataclasses.replace(own, prefill_started_s=None)
    assert with_peer_load(unknown, total).prefill_started_s is None
    idle = WorkerView(W0)
    assert with_peer_load(idle, total).prefill_started_s == 8.0
    assert with_peer_load(idle, dataclasses.replace(total, prefill_since_s=None)).prefill_started_s is None


def test_the_share_of_the_rate_scales_the_progress() -> None:
    full = CostModel(CostModelParams(prefill_progress=1.0))
    half = CostModel(CostModelParams(prefill_progress=0.5))
    view = _busy(80_000, started_s=0.0)
    assert half.prefill_remaining(view, 2.0) == pytest.approx(full.prefill_remaining(view, 1.0), abs=1)
    with pytest.raises(ValueError, match="prefill_progress"):
        CostModelParams(prefill_progress=1.5)


def test_a_full_snapshot_keeps_the_restart_time_of_unchanged_load() -> None:
    loads = PeerLoads()
    loads.note("a", [PeerLoad("p", W0, 1, 40_000, 100), PeerLoad("p", W1, 1, 900, 10)], 1.0, full=True)
    loads.note("a", [PeerLoad("p", W0, 1, 40_000, 100), PeerLoad("p", W1, 2, 1_900, 20)], 4.0, full=True)
    w0, w1 = loads.total("p", W0), loads.total("p", W1)
    assert w0 is not None and w0.prefill_since_s == 1.0
    assert w1 is not None and w1.prefill_since_s == 4.0
