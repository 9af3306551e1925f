import pytest

from policies import RouteRequest, WorkerId, WorkerView, known_policies, make_policy


def _req(i: int = 0) -> RouteRequest:
    return RouteRequest(
        request_id=f"r{i}",
        pool="p",
        tenant="t",
        namespace="t",
        block_keys=(),
        n_prompt_tokens=10,
        block_size_tokens=16,
    )


def _workers(*loads: int, healthy: tuple[bool, ...] | None = None) -> list[WorkerView]:
    ok = healthy or (True,) * len(loads)
    return [
        WorkerView(WorkerId(f"w{i}"), healthy=h, in_flight_requests=n)
        for i, (n, h) in enumerate(zip(loads, ok, strict=False))
    ]


def test_round_robin_cycles_over_healthy_workers() -> None:
    rr = make_policy("round_robin")
    ws = _workers(0, 0, 0, healthy=(True, False, True))
    picks = [rr.select(_req(i), ws, 0.0) for i in range(4)]
    assert [p.worker if p else None for p in picks] == ["w0", "w2", "w0", "w2"]


def test_least_load_picks_fewest_in_flight_and_skips_full_workers() -> None:
    ll = make_policy("least_load")
    ws = [
        WorkerView(WorkerId("a"), in_flight_requests=3),
        WorkerView(WorkerId("b"), in_flight_requests=1, max_in_flight=1),
        WorkerView(WorkerId("c"), in_flight_requests=2),
    ]
    decision = ll.select(_req(), ws, 0.0)
    assert decision is not None and decision.worker == "c"


def test_no_candidate_gives_none() -> None:
    assert make_policy("least_load").select(_req(), _workers(0, healthy=(False,)), 0.0) is None


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("nope")
    assert {"round_robin", "least_load"} <= set(known_policies())
