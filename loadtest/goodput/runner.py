"""One point of the goodput search: a trace slice replayed at one rate scale through one policy.

A trace is loaded and keyed once (`prepare_trace`); every point reuses those keys, since a
request's keys do not depend on when it arrives, and gets fresh engines and a fresh policy. The
loop is the simulator's own (`loadtest.simulator.loop.run_loop`), wired as `kvgate simulate`
wires it, without the hit ceilings, which the goodput search does not need.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest.engine import Engine, EngineConfig, EngineRequest, StepProfile
from loadtest.engine.hashing import block_hashes
from loadtest.goodput.config import PolicyEntry, TraceSpec, as_entry
from loadtest.goodput.watch import PointHopeless, watch_policy
from loadtest.simulator.cli import vllm_pd_sim
from loadtest.simulator.keys import KeyedPrompt, KeyPath
from loadtest.simulator.loop import EngineHooks, LoopConfig, run_loop
from loadtest.simulator.pd import PdSim
from loadtest.simulator.records import RequestRecord
from loadtest.simulator.summary import summarize
from loadtest.traces.load import load_trace
from loadtest.workloads.records import WorkloadRequest, scale_arrivals
from policies.config import build_policy
from policies.registry import make_policy


@dataclass(frozen=True, slots=True)
class TraceSetup:
    """A trace slice, sorted by arrival, with its keys (computed once for every point)."""

    name: str
    spec: TraceSpec
    requests: tuple[WorkloadRequest, ...]
    keyed: tuple[KeyedPrompt, ...]
    keys: KeyPath
    profile: StepProfile


@dataclass(frozen=True, slots=True)
class SimSettings:
    """What every point of a run shares besides the trace: pool size, engine, seed, scrape period."""

    workers: int
    seed: int
    scrape_interval_s: float


def slice_requests(
    requests: Sequence[WorkloadRequest], *, max_requests: int | None, window_s: float | None
) -> list[WorkloadRequest]:
    """The requests arriving within `window_s` of the first one (trace time, before any rate
    scaling), then at most the first `max_requests` of them; sorted by arrival."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    if window_s is not None and ordered:
        end_s = ordered[0].arrival_s + window_s
        ordered = [r for r in ordered if r.arrival_s < end_s]
    if max_requests is not None:
        ordered = ordered[:max_requests]
    return ordered


def prepare_trace(
    name: str,
    spec: TraceSpec,
    profile: StepProfile,
    *,
    seed: int,
    requests: Sequence[WorkloadRequest] | None = None,
    max_requests: int | None = None,
    window_s: float | None = None,
) -> TraceSetup:
    """Load trace `name` (a shipped name or a path) as `spec` replays it, slice and key it.

    `requests` replaces the trace file (tests pass small generated workloads); the command-line
    slice, when given, overrides the spec's."""
    if requests is None:
        loaded = load_trace(spec.trace or name, users=spec.users, user_spread_s=spec.user_spread_s, seed=seed)
        requests = loaded.requests
    reqs = slice_requests(
        requests,
        max_requests=max_requests if max_requests is not None else spec.max_requests,
        window_s=window_s if window_s is not None else spec.window_s,
    )
    if not reqs:
        raise ValueError(f"trace {name}: no requests in the slice")
    keys = KeyPath()
    keyed = tuple(keys.keyed(r) for r in reqs)
    return TraceSetup(name, spec, tuple(reqs), keyed, keys, profile)


@dataclass(frozen=True, slots=True)
class PointResult:
    """What one simulated point measured. `attainment` = requests meeting both SLOs / all requests
    (a request no worker took, or that produced no token, misses them).

    A point stopped early (`complete` False) failed for certain: its `attainment` is an upper bound
    (every request not yet judged counted as met), and the latency figures are None. `users` is
    the number of users the trace was replayed as (None in points stored before it was kept).
    """

    rate_scale: float
    n_requests: int
    n_met: int
    attainment: float
    complete: bool
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    utilization: float | None
    hit_ratio: float | None
    wall_s: float
    users: int | None = None

    def passes(self, share: float) -> bool:
        return self.complete and self.attainment >= share


def count_met(records: Sequence[RequestRecord], ttft_slo_s: float, tpot_slo_s: float) -> int:
    """Requests that finished with TTFT ≤ `ttft_slo_s` and TPOT ≤ `tpot_slo_s` (a one-token
    answer has no TPOT and is judged by its TTFT alone)."""
    return sum(
        1
        for r in records
        if r.ttft_s is not None and r.ttft_s <= ttft_slo_s and (r.tpot_s is None or r.tpot_s <= tpot_slo_s)
    )


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def pd_sim(entry: PolicyEntry, profile: StepProfile, seed: int) -> PdSim | None:
    """The P/D side of the loop for a row with `pd`, wired as `kvgate simulate --pd` wires it."""
    return vllm_pd_sim(entry.pd, profile, seed, entry.pd_conditional)


def run_point(
    setup: TraceSetup,
    policy_name: str | PolicyEntry,
    rate_scale: float,
    sim: SimSettings,
    *,
    stop_below_share: float | None = None,
) -> PointResult:
    """Replay the slice at `rate_scale` through a fresh policy on fresh engines: `sim.workers`
    mixed ones, or the entry's P/D split.

    With `stop_below_share`, the replay stops as soon as that share of requests can no longer
    meet the SLOs (`loadtest.goodput.watch`)."""
    entry = as_entry(policy_name)
    reqs = scale_arrivals(list(setup.requests), rate_scale) if rate_scale != 1.0 else list(setup.requests)
    spec = setup.spec
    pd = pd_sim(entry, setup.profile, sim.seed)
    split = entry.split()
    n_workers = sim.workers if split is None else sum(split)
    engine_config = EngineConfig(kv_blocks=spec.kv_blocks_per_worker, seed=sim.seed)
    engines = [Engine(setup.profile, engine_config) for _ in range(n_workers)]
    config = entry.policy_config(sim.seed, spec.ttft_slo_s)
    policy = make_policy(entry.policy, seed=sim.seed) if config is None else build_policy(config)
    if stop_below_share is not None:
        arrivals = {r.request_id: r.arrival_s for r in reqs}
        policy = watch_policy(
            policy,
            arrivals,
            ttft_slo_s=spec.ttft_slo_s,
            tpot_slo_s=spec.tpot_slo_s,
            share=stop_below_share,
            pd=pd is not None,
            closed_loop=spec.closed_loop,
        )

    def make_request(request_id: str, n_prompt: int, max_out: int, hashes: Any) -> EngineRequest:
        return EngineRequest(request_id, n_prompt, max_out, hashes)

    def hash_tokens(tokens: Any, size: int, salt: str | None) -> list[int]:
        return block_hashes(tokens, size, salt, sim.seed)

    started = time.monotonic()
    try:
        result = run_loop(
            reqs,
            engines,
            policy,
            EngineHooks(make_request, hash_tokens, setup.keys),
            LoopConfig(scrape_interval_s=sim.scrape_interval_s, pd=pd, closed_loop=setup.spec.closed_loop),
            keyed=setup.keyed,
        )
    except PointHopeless as stop:
        n = len(reqs)
        return PointResult(
            rate_scale, n, n - stop.n_missed, (n - stop.n_missed) / n, False,
            None, None, None, None, None, None, time.monotonic() - started, spec.users,
        )  # fmt: skip
    wall_s = time.monotonic() - started
    records = result.requests
    summary = summarize(records, result.workers, ceiling_infinite=0.0, ceiling_pooled_lru=0.0)
    n_met = count_met(records, spec.ttft_slo_s, spec.tpot_slo_s)
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    tpot = [r.tpot_s for r in records if r.tpot_s is not None]
    return PointResult(
        rate_scale=rate_scale,
        n_requests=len(records),
        n_met=n_met,
        attainment=n_met / len(records) if records else 0.0,
        complete=True,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p99_s=_pct(ttft, 99),
        tpot_p50_s=_pct(tpot, 50),
        tpot_p99_s=_pct(tpot, 99),
        utilization=float(summary["utilization"]),
        hit_ratio=float(summary["hit_ratio"]),
        wall_s=wall_s,
        users=spec.users,
    )
