"""The event loop against a small scripted engine (the real engine model is exercised by the CLI tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from loadtest.simulator.loop import EngineHooks, LoopConfig, run_loop
from loadtest.simulator.summary import summarize
from loadtest.workloads.records import BlockPrompt, TextPrompt, WorkloadRequest
from policies.base import KvEvent, Observation, RouteDecision, RouteRequest, WorkerView, prefill_pairs
from policies.registry import make_policy


@dataclass(frozen=True)
class _Req:
    request_id: str
    num_prompt_tokens: int
    max_output_tokens: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class _First:
    request_id: str
    num_cached_tokens: int


@dataclass(frozen=True)
class _Fin:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class _Stored:
    request_id: str
    first_block_index: int
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None


@dataclass(frozen=True)
class _Step:
    start_s: float
    duration_s: float
    num_prefill_tokens: int
    first_tokens: tuple[_First, ...]
    finished: tuple[_Fin, ...]
    stored: tuple[_Stored, ...] = ()
    removed: tuple[int, ...] = ()
    num_steps: int = 1

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class _Stats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int = 100
    kv_usage: float = 0.0


@dataclass
class ScriptedEngine:
    """Each step prefills every waiting request at 1 ms/uncached token and decodes one token for the rest."""

    block_size: int = 16
    cache: set[int] = field(default_factory=set)
    waiting: list[_Req] = field(default_factory=list)
    running: dict[str, list[Any]] = field(default_factory=dict)

    def submit(self, req: _Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> _Stats:
        return _Stats(len(self.running), len(self.waiting))

    def step(self, now_s: float, until_s: float | None = None) -> _Step:
        firsts, fins, stored = [], [], []
        prefill = 0
        for name, state in list(self.running.items()):
            state[1] += 1
            if state[1] >= state[0].max_output_tokens:
                del self.running[name]
                fins.append(_Fin(name, state[0].num_prompt_tokens, state[2], state[1]))
        for r in self.waiting:
            hit = 0
            for h in r.block_hashes:
                if h not in self.cache:
                    break
                hit += 1
            cached = hit * self.block_size
            prefill += r.num_prompt_tokens - cached
            self.cache.update(r.block_hashes)
            stored.append(_Stored(r.request_id, hit, tuple(r.block_hashes[hit:]), None))
            firsts.append(_First(r.request_id, cached))
            self.running[r.request_id] = [r, 1, cached]
        self.waiting = []
        return _Step(now_s, 0.005 + 0.001 * prefill, prefill, tuple(firsts), tuple(fins), tuple(stored))


def _hooks() -> EngineHooks:
    def hash_tokens(tokens: np.ndarray, block: int, salt: str | None) -> list[int]:
        return [hash((salt, bytes(tokens[: (i + 1) * block]))) for i in range(len(tokens) // block)]

    return EngineHooks(make_request=lambda *a: _Req(a[0], a[1], a[2], tuple(a[3])), hash_tokens=hash_tokens)


def _trace(n: int, gap_s: float) -> list[WorkloadRequest]:
    # Every request shares block 1 (64 tokens) then has its own block.
    return [
        WorkloadRequest(f"r{i}", i * gap_s, "t", f"s{i}", BlockPrompt((1, 100 + i), 64, 100), 4)
        for i in range(n)
    ]


class Spy:
    """Wraps a policy and records what the loop fed it."""

    name = "spy"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.views: list[Sequence[WorkerView]] = []
        self.dispatched: list[str] = []
        self.completed: list[Observation] = []
        self.events: list[KvEvent] = []

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        self.views.append(workers)
        decision: RouteDecision | None = self.inner.select(req, workers, now_s)
        return decision

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        self.dispatched.append(req.request_id)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self.completed.append(obs)

    def on_kv_event(self, worker: Any, event: KvEvent, now_s: float) -> None:
        self.events.append(event)


def test_round_robin_spreads_and_reports_cached_tokens_and_ttft() -> None:
    spy = Spy(make_policy("round_robin"))
    engines = [ScriptedEngine(), ScriptedEngine()]
    res = run_loop(_trace(6, 1.0), engines, spy, _hooks())
    assert [r.worker for r in sorted(res.requests, key=lambda r: r.arrival_s)] == ["w0", "w1"] * 3
    by_id = {r.request_id: r for r in res.requests}
    # First request on each worker is cold; later ones hit the shared 64-token block (4 engine blocks).
    assert by_id["r0"].cached_tokens == 0 and by_id["r1"].cached_tokens == 0
    assert all(by_id[f"r{i}"].cached_tokens == 64 for i in range(2, 6))
    # TTFT = one step of 5 ms + 1 ms per uncached token (arrivals are 1 s apart: no queueing).
    assert by_id["r0"].ttft_s == pytest.approx(0.005 + 0.100)
    assert by_id["r2"].ttft_s == pytest.approx(0.005 + 0.036)
    assert by_id["r0"].output_tokens == 4 and by_id["r0"].tpot_s is not None
    assert sorted(spy.dispatched) == sorted(by_id)
    assert {o.cached_tokens for o in spy.completed} == {0, 64} and all(o.ttft_s for o in spy.completed)
    assert spy.events == []  # KV events are off by default
    summary = summarize(res.requests, res.workers, ceiling_infinite=0.5, ceiling_pooled_lru=0.5)
    assert summary["hit_ratio"] == pytest.approx(4 * 64 / 600)
    assert summary["n_requests"] == 6 and summary["cold_start"]["n_requests"] == 1


def test_views_carry_in_flight_accounting_and_kv_events_flow_when_enabled() -> None:
    spy = Spy(make_policy("round_robin"))
    engines = [ScriptedEngine(), ScriptedEngine()]
    reqs = _trace(4, 0.0)  # all at t=0: nothing has finished when the last one is routed
    res = run_loop(reqs, engines, spy, _hooks(), LoopConfig(kv_events=True))
    assert sorted(r.worker or "" for r in res.requests) == ["w0", "w0", "w1", "w1"]
    last_view = {v.worker_id: v for v in spy.views[-1]}
    # The fourth arrival sees w0 with two requests waiting for prefill, w1 with one.
    assert last_view["w0"].in_flight_requests == 2 and last_view["w0"].in_flight_prefill_tokens == 200
    assert last_view["w1"].in_flight_requests == 1
    # round_robin predicts no match: each pending 100-token prompt computes 100·50 attention pairs.
    assert last_view["w0"].in_flight_prefill_pairs == 2 * prefill_pairs(100, 0) == 10_000
    assert last_view["w0"].engine_block_size == 16
    assert all(v.in_flight_prefill_pairs == 0 for v in spy.views[0])  # the first arrival: none
    assert spy.events and spy.events[0].block_size == 16


def test_views_count_the_decode_context_of_requests_past_their_first_token() -> None:
    # r0 (100 prompt tokens, 100 output) is decoding on w0 when r1 arrives; it has finished when
    # r2 does. Its context is its prompt plus half its maximum output, as the gateway counts it.
    spy = Spy(make_policy("round_robin"))
    reqs = [
        WorkloadRequest("r0", 0.0, "t", "s0", BlockPrompt((1, 100), 64, 100), 100),
        WorkloadRequest("r1", 0.2, "t", "s1", BlockPrompt((2, 101), 64, 100), 4),
        WorkloadRequest("r2", 5.0, "t", "s2", BlockPrompt((3, 102), 64, 100), 4),
    ]
    run_loop(reqs, [ScriptedEngine(), ScriptedEngine()], spy, _hooks())
    first, second, third = ({v.worker_id: v.decode_context_tokens for v in views} for views in spy.views)
    assert first == {"w0": 0, "w1": 0}
    assert second == {"w0": 150, "w1": 0}
    assert third == {"w0": 0, "w1": 0}
    # r0's prefill attention counted until its first token only.
    assert all(v.in_flight_prefill_pairs == 0 for views in spy.views for v in views)


def test_text_prompts_are_hashed_from_their_bytes() -> None:
    text = "x" * 40
    reqs = [WorkloadRequest(f"r{i}", float(i), "t", "s", TextPrompt(text), 2) for i in range(2)]
    res = run_loop(reqs, [ScriptedEngine()], make_policy("round_robin"), _hooks())
    assert [r.cached_tokens for r in sorted(res.requests, key=lambda r: r.arrival_s)] == [0, 32]


def test_a_policy_that_declines_leaves_a_rejected_record() -> None:
    class Never(Spy):
        def select(
            self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float
        ) -> RouteDecision | None:
            return None

    res = run_loop(_trace(2, 1.0), [ScriptedEngine()], Never(None), _hooks())
    assert [r.worker for r in res.requests] == [None, None]
    summary = summarize(res.requests, res.workers, ceiling_infinite=0.0, ceiling_pooled_lru=0.0)
    assert summary["n_rejected"] == 2 and summary["ttft_p50_s"] is None


def _turn(rid: str, arrival_s: float, follows: tuple[str, ...] = (), think_s: float = 0.0) -> WorkloadRequest:
    return WorkloadRequest(rid, arrival_s, "t", "s", BlockPrompt((1, 2), 64, 100), 4, follows, think_s)


def test_a_closed_loop_sends_a_turn_its_think_time_after_the_answers_it_follows() -> None:
    # r1 follows r0; r2 follows r1 and the sub-agent's s0; x is its own session. The recording
    # sent them all at 0: open, they all arrive then; closed, each waits for the answers it needs.
    reqs = [
        _turn("r0", 0.0),
        _turn("s0", 0.0, ("r0",), think_s=2.0),
        _turn("r1", 0.0, ("r0",), think_s=0.5),
        _turn("r2", 0.0, ("r1", "s0"), think_s=0.25),
        _turn("x", 0.0, ("not-in-this-slice",), think_s=9.0),
    ]
    opened = run_loop(reqs, [ScriptedEngine()], make_policy("round_robin"), _hooks())
    assert {r.arrival_s for r in opened.requests} == {0.0}
    closed = LoopConfig(closed_loop=True)
    res = run_loop(reqs, [ScriptedEngine()], make_policy("round_robin"), _hooks(), closed)
    by_id = {r.request_id: r for r in res.requests}
    r0, s0, r1, r2 = (by_id[k] for k in ("r0", "s0", "r1", "r2"))
    assert r0.finish_s is not None and s0.finish_s is not None and r1.finish_s is not None
    assert s0.arrival_s == pytest.approx(r0.finish_s + 2.0)
    assert r1.arrival_s == pytest.approx(r0.finish_s + 0.5)
    assert s0.finish_s > r1.finish_s  # r2 waits for the later of its two
    assert r2.arrival_s == pytest.approx(s0.finish_s + 0.25)
    assert by_id["x"].arrival_s == 0.0  # a predecessor outside the workload does not hold it back
    assert r2.ttft_s is not None and r2.ttft_s < 0.2  # measured from when it was sent


def test_a_turn_after_a_refused_one_is_sent_when_the_refusal_came() -> None:
    class Never(Spy):
        def select(
            self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float
        ) -> RouteDecision | None:
            return None

    reqs = [_turn("r0", 1.0), _turn("r1", 0.0, ("r0",), think_s=0.5)]
    res = run_loop(reqs, [ScriptedEngine()], Never(None), _hooks(), LoopConfig(closed_loop=True))
    assert {r.request_id: r.arrival_s for r in res.requests} == {"r0": 1.0, "r1": 1.5}
    assert all(r.worker is None for r in res.requests)
