"""The simulator's views carry when each worker's prefill backlog last restarted, from the loop's
own gateway-side accounting, as the gateway's registry keeps it (`WorkerView.prefill_started_s`)."""

from __future__ import annotations

import pytest

from loadtest.simulator.loop import run_loop
from loadtest.workloads.records import BlockPrompt, WorkloadRequest
from policies.registry import make_policy
from tests.loadtest.test_simulator_loop import ScriptedEngine, Spy, _hooks


def _request(i: int, at_s: float) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", at_s, "t", f"s{i}", BlockPrompt((100 + i,), 96, 96), 4)


def test_the_backlog_restarts_at_its_first_dispatch_and_at_each_first_token() -> None:
    spy = Spy(make_policy("round_robin"))
    # One worker; each step prefills all that waits at 1 ms a token (+5 ms): r0 alone until 0.101 s.
    arrivals = [0.0, 0.01, 0.05, 0.2, 1.0]
    run_loop([_request(i, t) for i, t in enumerate(arrivals)], [ScriptedEngine()], spy, _hooks())
    seen = [(v[0].in_flight_prefill_tokens, v[0].prefill_started_s) for v in spy.views]
    assert seen[0] == (0, None)
    # r1 and r2 join a backlog already being worked on since r0's dispatch.
    assert seen[1] == (96, 0.0) and seen[2] == (192, 0.0)
    # r0's first token at 0.101 s: r1 and r2 are worked on from then at the earliest.
    assert seen[3][0] == 192 and seen[3][1] == pytest.approx(0.101)
    assert seen[4] == (0, None)
