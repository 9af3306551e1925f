"""The event loop: arrivals and engine steps in virtual time.

One event kind per worker: `step(w)` at time t first applies the outputs of w's previous step
(they become visible at t: first tokens, completions, KV events, all fed back to the policy as the
gateway would), then, if w has work, runs its next step and schedules `step(w)` at the step's end.
An arrival routes through the policy and submits to the chosen engine, waking it if idle, so a
request that arrives during a step joins the next one, as with a real engine. Pure-decode steps are
coalesced by the engine up to the next arrival (nothing can be routed in between), which is what
keeps a 145 M-token trace fast.

The policy sees a `WorkerView` (`views.py`) built from its gateway's in-flight accounting
(`SimGateway`, as the gateway keeps it) plus the last scrape of the engine's stats, refreshed every
`scrape_interval_s` of virtual time.
With several gateways (`gateways.py`) each request goes to one of them, whose policy routes it and
whose accounting counts it; every gateway gets the workers' KV events, and with sync each applies
what the others publish, delivered by the `SyncBus` between the other events; a request its
gateway holds (`SimGateway.hold_s`) is decided at the hold's end, an event of its own.
In a closed loop (`LoopConfig.closed_loop`) a request that follows others (`WorkloadRequest.follows`:
an agent's next turn) arrives its think time after the last of them has finished (or failed), as a
client that needs the answer sends it; the others arrive when the workload says.
Invariant: virtual time never goes backwards; heap entries are (time, seq, worker index, or
`TRANSFER` / `HELD` for the other events).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from loadtest.simulator.engine_hashes import TokenHasher, request_hashes
from loadtest.simulator.flights import Flight, SimWorker, kv_events
from loadtest.simulator.gateways import SimGateway, SyncBus, pick_gateway
from loadtest.simulator.keys import KeyedPrompt, KeyPath
from loadtest.simulator.pd import PdSim
from loadtest.simulator.port import KvChanges, RequestFactory, SimEngine, StepLike
from loadtest.simulator.records import RequestRecord, WorkerRecord
from loadtest.simulator.views import GatewayViews
from loadtest.workloads.records import WorkloadRequest
from policies.base import (
    Observation,
    Outcome,
    Role,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerId,
    decode_context_of,
    prefill_pairs,
)

# Heap entries that are not a worker's step: a KV transfer's end, a held request's decision.
TRANSFER = -1
HELD = -2


@dataclass(frozen=True, slots=True)
class Held:
    """A request its gateway holds before deciding it (`SimGateway.hold_s`)."""

    req: WorkloadRequest
    kp: KeyedPrompt
    route: RouteRequest
    gateway: SimGateway


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """Knobs of the loop itself (not of the engine or the policy)."""

    scrape_interval_s: float = 1.0
    kv_events: bool = False
    max_in_flight_per_worker: int | None = None
    sync_delay_s: float | None = None  # None: gateways do not share what they learn
    balancer_seed: int = 0
    pd: PdSim | None = None  # prefill/decode roles and pair routing (loadtest/simulator/pd.py)
    closed_loop: bool = False  # requests that follow others wait for their answers (module doc)


@dataclass(frozen=True, slots=True)
class LoopResult:
    requests: tuple[RequestRecord, ...]
    workers: tuple[WorkerRecord, ...]
    n_steps: int
    n_engine_calls: int
    n_sync_items: int = 0  # items the gateways published to each other


@dataclass(frozen=True, slots=True)
class EngineHooks:
    """How the loop talks to a concrete engine (build its request record, hash token ids) and the
    gateway's key path that turns a workload request into keys, a `RouteRequest` and a salt."""

    make_request: RequestFactory
    hash_tokens: TokenHasher
    keys: KeyPath = field(default_factory=KeyPath)


class _Loop:
    def __init__(
        self,
        requests: Sequence[WorkloadRequest],
        engines: Sequence[SimEngine],
        policies: Sequence[RoutingPolicy],
        config: LoopConfig,
        hooks: EngineHooks,
        progress: Callable[[int], None] | None,
        keyed: Sequence[KeyedPrompt] | None,
    ) -> None:
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        self.keyed = None if keyed is None else [keyed[i] for i in order]
        self.arrivals = _Arrivals([requests[i] for i in order], config.closed_loop)
        self.clock_s = 0.0  # the time of the event being handled
        self.workers = [SimWorker(f"w{i}", e) for i, e in enumerate(engines)]
        self.by_id = {w.id: i for i, w in enumerate(self.workers)}
        self.gateways = [SimGateway(i, p, len(engines)) for i, p in enumerate(policies)]
        self.bus = None if config.sync_delay_s is None else SyncBus(self.gateways, config.sync_delay_s)
        self.config = config
        self.hooks = hooks
        self.progress = progress
        self.flights: dict[str, Flight] = {}
        self.records: list[RequestRecord] = []
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        self.n_steps = 0
        self.n_calls = 0
        # Requests held by their gateway, by event key, and when their holds end (a heap: the held
        # events leave the main heap in time order, so each takes the smallest).
        self.held: dict[int, Held] = {}
        self.held_ends: list[float] = []
        self.pd = config.pd
        self.roles = [Role.MIXED] * len(engines) if self.pd is None else self.pd.roles(len(engines))
        self.views = GatewayViews(
            self.workers, self.gateways, self.roles, config.scrape_interval_s, config.max_in_flight_per_worker
        )

    def _record(
        self,
        f: Flight,
        worker: str | None,
        first_s: float | None,
        end_s: float | None,
        prompt: int,
        cached: int,
        out: int,
    ) -> None:
        req = f.req
        ttft = None if first_s is None else first_s - req.arrival_s
        tpot = None if first_s is None or end_s is None or out < 2 else (end_s - first_s) / (out - 1)
        e2e = None if end_s is None else end_s - req.arrival_s
        self.records.append(
            RequestRecord(
                req.request_id, req.tenant, req.session, worker, req.arrival_s, first_s, end_s,
                ttft, tpot, e2e, prompt, cached, out, f.decision.matched_tokens, f.decision.reason,
            )
        )  # fmt: skip
        if self.progress is not None:
            self.progress(len(self.records))
        self.arrivals.answered(req.request_id, self.clock_s if end_s is None else end_s)

    def kv_events(self, w: SimWorker, out: KvChanges, now_s: float) -> None:
        """The worker's KV events, to every gateway's policy (`flights.kv_events`)."""
        for ev in kv_events(out, w.engine.block_size, self.flights, self.hooks.keys):
            for gw in self.gateways:
                gw.policy.on_kv_event(w.id, ev, now_s)

    def apply(self, idx: int, w: SimWorker, out: StepLike) -> None:
        now_s = out.end_s
        changed: dict[tuple[SimGateway, str], None] = {}
        if self.config.kv_events:
            # Before the completions: a request that finishes in this step still owns its tokens.
            self.kv_events(w, out, now_s)
        w.busy_s += out.duration_s
        w.prefill_tokens += out.num_prefill_tokens
        w.n_steps += out.num_steps
        self.n_steps += out.num_steps
        for ft in out.first_tokens:
            f = self.flights[str(ft.request_id)]
            f.first_token_s = now_s
            gw = f.gateway
            assert gw is not None
            f.context = decode_context_of(f.route.n_prompt_tokens, f.max_out)
            gw.first_token(idx, f.route.n_prompt_tokens, f.pairs, f.context, now_s)
            changed[(gw, f.route.pool)] = None
        for fin in out.finished:
            f = self.flights.pop(str(fin.request_id))
            first = f.first_token_s if f.first_token_s is not None else now_s
            gw = f.gateway
            assert gw is not None
            gw.finished(idx, f.max_out, f.context)
            f.context = 0  # a P/D flight goes on to its decode leg
            changed[(gw, f.route.pool)] = None
            w.cached_tokens += fin.num_cached_tokens
            w.output_tokens += fin.num_output_tokens
            if f.leg is not None and self.pd is not None:
                self.pd.prefill_done(self, w.id, f, fin, first, now_s)
                continue
            cached = fin.num_cached_tokens if f.visible_cached is None else f.visible_cached
            self._record(f, str(w.id), first, now_s, fin.num_prompt_tokens, cached, fin.num_output_tokens)
            obs = Observation(
                f.route,
                w.id,
                ttft_s=first - f.decided_s,
                prompt_tokens=fin.num_prompt_tokens,
                cached_tokens=cached,
                completion_tokens=fin.num_output_tokens,
            )
            gw.policy.on_complete(obs, now_s)
        if self.bus is not None:
            for gw, pool in changed:
                self.bus.load_changed(gw, pool, w.id, idx, now_s)

    def run_step(self, idx: int, now_s: float) -> None:
        w = self.workers[idx]
        if w.pending is not None:
            out, w.pending = w.pending, None
            self.apply(idx, w, out)
        until_s = self.arrivals.horizon_s(now_s)
        if self.pd is not None:
            until_s = min(until_s, self.pd.horizon_s(self, idx))
        if self.held_ends:
            # A held request is routed at its hold's end: no step may be coalesced past it.
            until_s = min(until_s, self.held_ends[0])
        res = w.engine.step(now_s, until_s) if w.engine.has_work() else None
        if res is None:
            w.busy = False
            return
        self.n_calls += 1
        w.pending = res
        self.seq += 1
        # A zero-length step would spin at one instant forever; engines report positive durations.
        heapq.heappush(self.heap, (max(res.end_s, now_s + 1e-9), self.seq, idx))
        w.busy = True

    def arrive(self, req: WorkloadRequest, kp: KeyedPrompt | None) -> None:
        now_s = req.arrival_s
        hooks = self.hooks
        if kp is None:
            kp = hooks.keys.keyed(req)
        route = hooks.keys.route_request(req, kp)
        gw = self.gateways[pick_gateway(req.request_id, len(self.gateways), self.config.balancer_seed)]
        if self.pd is not None:
            self.pd.arrive(self, gw, req, kp, route, now_s)
            return
        hold_s = gw.hold_s(route, now_s) if self.bus is not None else 0.0
        if hold_s > 0:
            self.held[self.schedule(now_s + hold_s, HELD)] = Held(req, kp, route, gw)
            heapq.heappush(self.held_ends, now_s + hold_s)
            return
        self.decide(gw, req, kp, route, now_s)

    def decide(
        self, gw: SimGateway, req: WorkloadRequest, kp: KeyedPrompt, route: RouteRequest, now_s: float
    ) -> None:
        """Gateway `gw` routes `req` at `now_s` (its arrival, or the end of its hold)."""
        hooks = self.hooks
        decision = gw.policy.select(route, self.views(now_s, gw, route.pool), now_s)
        idx = self.by_id.get(decision.worker, -1) if decision is not None else -1
        if decision is None or idx < 0:
            self.reject(req, route, decision.reason if decision else "no worker")
            return
        f = self.flight(gw, req, route, decision, kp)
        f.decided_s = now_s
        request = hooks.make_request(req.request_id, route.n_prompt_tokens, req.max_output_tokens, f.hashes)
        self.submit(idx, f, request, now_s)

    def reject(self, req: WorkloadRequest, route: RouteRequest, reason: str) -> None:
        """Record a request no worker could take."""
        rejected = RouteDecision(WorkerId(""), 0.0, reason)
        self._record(Flight(req, route, rejected), None, None, None, route.n_prompt_tokens, 0, 0)

    def flight(
        self,
        gw: SimGateway,
        req: WorkloadRequest,
        route: RouteRequest,
        decision: RouteDecision,
        kp: KeyedPrompt,
    ) -> Flight:
        """A request gateway `gw` is about to dispatch as `decision` says, with its salt and engine
        hashes."""
        hooks = self.hooks
        salt = hooks.keys.cache_salt(route, decision)
        f = Flight(req, route, decision, kp, salt, gw)
        f.hashes = request_hashes(req, kp.tokens, self.workers[0].engine.block_size, salt, hooks.hash_tokens)
        return f

    def submit(self, idx: int, f: Flight, request: object, now_s: float) -> bool:
        """Hand `request` (the engine's record of flight `f`) to worker `idx`, tell the flight's
        gateway of the dispatch, and wake the worker; False (recorded as rejected) if the engine
        refuses it."""
        w = self.workers[idx]
        gw, decision, route = f.gateway, f.decision, f.route
        assert gw is not None
        try:
            w.engine.submit(request)
        except ValueError:
            failed = RouteDecision(decision.worker, decision.score_s, "engine rejected")
            self._record(Flight(f.req, route, failed), None, None, None, route.n_prompt_tokens, 0, 0)
            gw.policy.on_complete(Observation(route, decision.worker, outcome=Outcome.REJECTED), now_s)
            return False
        gw.policy.on_dispatch(route, decision, now_s)
        self.flights[f.req.request_id] = f
        f.pairs = prefill_pairs(route.n_prompt_tokens, decision.matched_tokens)
        gw.dispatched(idx, route.n_prompt_tokens, f.pairs, f.max_out, now_s)
        if self.bus is not None:
            self.bus.load_changed(gw, route.pool, w.id, idx, now_s)
        w.n_requests += 1
        w.prompt_tokens += route.n_prompt_tokens
        if not w.busy:
            w.busy = True
            self.seq += 1
            heapq.heappush(self.heap, (now_s, self.seq, idx))
        return True

    def schedule(self, at_s: float, kind: int = TRANSFER) -> int:
        """An event at `at_s` that is not a worker's step (`TRANSFER`: a KV transfer's end, `HELD`:
        a held request's decision): its key."""
        self.seq += 1
        heapq.heappush(self.heap, (at_s, self.seq, kind))
        return self.seq

    def run(self) -> LoopResult:
        heap, bus, arrivals = self.heap, self.bus, self.arrivals
        while arrivals.due or heap:
            if bus is not None and bus.queue:
                # Sync first: what is due by the next event reaches the peers before it.
                bus.deliver_due(min(arrivals.next_s, heap[0][0] if heap else math.inf))
            if arrivals.due and (not heap or arrivals.next_s <= heap[0][0]):
                i = arrivals.pop()
                req = arrivals.requests[i]
                self.clock_s = req.arrival_s
                self.arrive(req, None if self.keyed is None else self.keyed[i])
                continue
            t, key, idx = heapq.heappop(heap)
            self.clock_s = t
            if idx == HELD:
                held = self.held.pop(key)
                heapq.heappop(self.held_ends)
                self.decide(held.gateway, held.req, held.kp, held.route, t)
                continue
            if idx < 0:
                assert self.pd is not None
                self.pd.transfer_done(self, key, t)
                continue
            self.run_step(idx, t)
        workers = tuple(
            WorkerRecord(
                str(w.id), w.n_requests, w.prompt_tokens, w.cached_tokens, w.prefill_tokens, w.output_tokens,
                w.busy_s, w.n_steps,
            )
            for w in self.workers
        )  # fmt: skip
        published = 0 if self.bus is None else self.bus.published
        return LoopResult(tuple(self.records), workers, self.n_steps, self.n_calls, published)


class _Arrivals:
    """The requests still to arrive, soonest first. In a closed loop a request that follows others
    is due only once the last of them has been answered (`answered`), `think_s` later; a
    predecessor the workload does not hold (a slice of a trace) is taken as answered."""

    def __init__(self, requests: list[WorkloadRequest], closed_loop: bool) -> None:
        self.requests = requests  # a request's arrival is rewritten when it becomes due
        self.heap: list[tuple[float, int]] = []
        self.dependents: dict[str, list[int]] = {}
        self.waiting: dict[int, int] = {}  # predecessors not yet answered
        self.ready_s: dict[int, float] = {}  # the latest answer of its predecessors so far
        # The shortest think time of a request still waiting: nothing can arrive sooner after now.
        self.min_think_s = math.inf
        index = {r.request_id: i for i, r in enumerate(requests)} if closed_loop else {}
        for i, r in enumerate(requests):
            before = [index[rid] for rid in r.follows if rid in index]
            if not before:
                self.heap.append((r.arrival_s, i))
                continue
            self.waiting[i] = len(before)
            self.min_think_s = min(self.min_think_s, r.think_s)
            for j in before:
                self.dependents.setdefault(requests[j].request_id, []).append(i)
        heapq.heapify(self.heap)

    @property
    def due(self) -> bool:
        return bool(self.heap)

    @property
    def next_s(self) -> float:
        return self.heap[0][0] if self.heap else math.inf

    def pop(self) -> int:
        return heapq.heappop(self.heap)[1]

    def horizon_s(self, now_s: float) -> float:
        """No request can arrive before this: the next due one, or one that an answer at `now_s`
        or later would release."""
        if not self.waiting:
            return self.next_s
        return min(self.next_s, now_s + self.min_think_s)

    def answered(self, request_id: str, at_s: float) -> None:
        """`request_id` was answered (or failed) at `at_s`: the requests it held back may be due."""
        for i in self.dependents.pop(request_id, ()):
            self.ready_s[i] = max(self.ready_s.get(i, at_s), at_s)
            self.waiting[i] -= 1
            if self.waiting[i] == 0:
                del self.waiting[i]
                at = self.ready_s.pop(i) + self.requests[i].think_s
                self.requests[i] = replace(self.requests[i], arrival_s=at)
                heapq.heappush(self.heap, (at, i))


def run_loop(
    requests: Sequence[WorkloadRequest],
    engines: Sequence[SimEngine],
    policy: RoutingPolicy | Sequence[RoutingPolicy],
    hooks: EngineHooks,
    config: LoopConfig = LoopConfig(),
    *,
    progress: Callable[[int], None] | None = None,
    keyed: Sequence[KeyedPrompt] | None = None,
) -> LoopResult:
    """Replay `requests` through `policy` onto `engines` until every request has finished or failed.

    A sequence of policies is one gateway each, behind a balancer (`gateways.py`). `keyed[i]` are
    `requests[i]`'s keys when the caller already computed them (for the ceilings); otherwise the
    loop keys each request on arrival."""
    policies = list(policy) if isinstance(policy, Sequence) else [policy]
    if not policies:
        raise ValueError("at least one gateway's policy is needed")
    return _Loop(requests, engines, policies, config, hooks, progress, keyed).run()
