"""A scrape is compared with the gateway's own requests at the scrape, not with those in flight now:
requests finished since do not weigh on the worker twice, others' load still does."""

from __future__ import annotations

from policies.base import Observation, WorkerId, WorkerView, reported_load
from policies.cost_policy import CostPolicy
from policies.pools import load_of
from tests.policies.factories import req


def _view(in_flight: int, waiting: int, running: int, at: int | None) -> WorkerView:
    return WorkerView(
        WorkerId("w0"),
        in_flight_requests=in_flight,
        num_requests_waiting=waiting,
        num_requests_running=running,
        in_flight_at_scrape=at,
    )


def test_a_scrape_without_the_gateways_count_then_is_taken_as_is() -> None:
    assert reported_load(_view(3, 1, 4, None)) == (1, 4)
    assert reported_load(WorkerView(WorkerId("w0"))) is None


def test_requests_finished_since_the_scrape_no_longer_count() -> None:
    # 5 requests (all the gateway's) at the scrape; 3 of its own in flight now.
    assert reported_load(_view(3, 1, 4, 5)) == (0, 3)
    assert load_of(_view(3, 1, 4, 5)) == 3


def test_load_from_elsewhere_is_kept_on_top_of_the_gateways_own() -> None:
    # 2 requests beyond the gateway's 4 at the scrape (one of them waiting); 1 of its own now.
    assert reported_load(_view(1, 1, 5, 4)) == (1, 2)
    assert load_of(_view(1, 1, 5, 4)) == 3


def test_a_stale_scrape_does_not_push_a_hot_prefix_off_its_holder() -> None:
    p = CostPolicy(seed=1)
    warm = req("warm", range(128))
    d = p.select(warm, [WorkerView(WorkerId("w0"))], 0.0)
    assert d is not None
    p.on_dispatch(warm, d, 0.0)
    p.on_complete(Observation(warm, d.worker, prompt_tokens=warm.n_prompt_tokens), 0.0)
    others = [
        WorkerView(WorkerId(f"w{i}"), in_flight_requests=2, in_flight_prefill_tokens=0) for i in (1, 2, 3)
    ]
    chosen = p.select(req("r", range(136)), [_view(3, 2, 4, 6), *others], 1.0)
    assert chosen is not None and (chosen.worker, chosen.reason) == ("w0", "hit")
