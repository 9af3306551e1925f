"""Prefill/decode disaggregation in virtual time (`kvgate simulate --pd P:D`).

The first P workers are prefill workers, the other D decode workers; with `--pd holder_prefill`
every worker is mixed and the chooser runs in that mode (policies/pd.py). Each request is routed by
the gateway's own pair chooser (`policies.pd.PdRouter`, with the simulated policy picking the
prefill worker) and runs as the gateway sends it under vLLM's protocol:

1. the prefill leg on the prefill worker's engine: the prompt and one output token;
2. when it finishes, the policy hears of it, the prefill engine holds the prompt's blocks, and the
   transfer starts: the prompt tokens the decode engine does not hold move in
   `StepProfile.kv_transfer_s` (the engine model's setup + bytes / bandwidth);
3. when the transfer ends, the hold is released, the decode engine installs the received blocks in
   its prefix cache (published as KV events like any stored block) and the decode leg is
   submitted with the prompt already computed (`EngineRequest.num_external_tokens`).

The request's TTFT is its decode worker's first token, its TPOT the decode worker's, and the
`cached_tokens` it reports the prefill leg's (as the gateway tells the client). A request that the
chooser sends to one worker alone runs there like any other.

Decode engines coalesce pure-decode steps only up to the next moment new work could reach them:
the next arrival, the end of a transfer in flight, or the end of the current step of a worker
running a prefill leg (which may start a transfer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from loadtest.simulator.keys import KeyedPrompt
from loadtest.simulator.port import PdEngine
from loadtest.workloads.records import WorkloadRequest
from policies.base import Observation, Role, RouteRequest, WorkerId
from policies.pd import HOLDER_PREFILL, PdDecision, PdRouter

if TYPE_CHECKING:
    from loadtest.simulator.flights import Flight
    from loadtest.simulator.gateways import SimGateway
    from loadtest.simulator.loop import _Loop
    from loadtest.simulator.port import FinishedLike


# (request_id, num_prompt_tokens, max_output_tokens, block_hashes, num_external_tokens) -> request
PdRequestFactory = Callable[[str, int, int, Sequence[int], int], Any]


@dataclass(frozen=True, slots=True)
class PrefillLeg:
    """A request whose prefill leg is running: the pair it was routed to."""

    decision: PdDecision
    decode_idx: int


@dataclass(slots=True)
class _Transfer:
    flight: Flight
    prefill_idx: int
    decode_idx: int
    at_s: float


@dataclass(slots=True)
class PdCounters:
    """What the P/D runs did: splits, requests run alone by reason, KV tokens moved."""

    splits: int = 0
    alone: dict[str, int] = field(default_factory=dict)
    transferred_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "splits": self.splits,
            "alone": dict(self.alone),
            "transferred_tokens": self.transferred_tokens,
        }


class PdSim:
    """The P/D side of the simulator's loop (the loop calls it at arrivals, at a prefill leg's end
    and at a transfer's end)."""

    def __init__(
        self,
        router: PdRouter,
        n_prefill: int,
        transfer_s: Callable[[int], float],
        make_request: PdRequestFactory,
    ) -> None:
        self.mixed = router.settings.mode == HOLDER_PREFILL
        if self.mixed != (n_prefill == 0):
            raise ValueError("a P/D pool needs at least one prefill worker, a holder_prefill pool none")
        self.router = router
        self.n_prefill = n_prefill
        self.transfer_s = transfer_s
        self.make_request = make_request
        self.counters = PdCounters()
        self._transfers: dict[int, _Transfer] = {}
        self._legs: dict[int, int] = {}  # worker index -> prefill legs running there

    def roles(self, n_workers: int) -> list[Role]:
        if self.mixed:
            return [Role.MIXED] * n_workers
        if n_workers <= self.n_prefill:
            raise ValueError("a P/D pool needs at least one decode worker")
        return [Role.PREFILL if i < self.n_prefill else Role.DECODE for i in range(n_workers)]

    def arrive(
        self,
        loop: _Loop,
        gw: SimGateway,
        req: WorkloadRequest,
        kp: KeyedPrompt,
        route: RouteRequest,
        now_s: float,
    ) -> None:
        """Route a new request as gateway `gw` would, and send its first leg."""
        decision = self.router.select(gw.policy, route, loop.views(now_s, gw, route.pool), now_s)
        if decision is None:
            loop.reject(req, route, "no worker")
            return
        decode_idx = loop.by_id[decision.decode.worker]
        n = route.n_prompt_tokens
        if decision.prefill is None:
            reason = decision.reason
            self.counters.alone[reason] = self.counters.alone.get(reason, 0) + 1
            f = loop.flight(gw, req, route, decision.decode, kp)
            request = self.make_request(req.request_id, n, req.max_output_tokens, f.hashes, 0)
            loop.submit(decode_idx, f, request, now_s)
            return
        self.counters.splits += 1
        f = loop.flight(gw, req, route, decision.prefill, kp)
        f.leg = PrefillLeg(decision, decode_idx)
        f.max_out = 1
        request = self.make_request(req.request_id, n, 1, f.hashes, 0)
        prefill_idx = loop.by_id[decision.prefill.worker]
        self._legs[prefill_idx] = self._legs.get(prefill_idx, 0) + 1
        loop.submit(prefill_idx, f, request, now_s)

    def prefill_done(
        self, loop: _Loop, worker: WorkerId, f: Flight, fin: FinishedLike, first_s: float, now_s: float
    ) -> None:
        """A prefill leg finished: tell the policy, hold the blocks, start the transfer."""
        leg = f.leg
        assert leg is not None
        obs = Observation(
            f.route,
            worker,
            ttft_s=first_s - f.req.arrival_s,
            prompt_tokens=fin.num_prompt_tokens,
            cached_tokens=fin.num_cached_tokens,
            completion_tokens=fin.num_output_tokens,
        )
        assert f.gateway is not None
        f.gateway.policy.on_complete(obs, now_s)
        prefill_idx = loop.by_id[worker]
        if self._legs[prefill_idx] == 1:
            del self._legs[prefill_idx]
        else:
            self._legs[prefill_idx] -= 1
        n = f.route.n_prompt_tokens
        held = _engine(loop, leg.decode_idx).prefix_hit_tokens(f.hashes, n)
        moved = max(0, n - held)
        self.counters.transferred_tokens += moved
        _engine(loop, prefill_idx).hold_blocks(f.req.request_id, f.hashes)
        # The decode leg: the client's request, the answer from the decode worker.
        f.decision = leg.decision.decode
        f.visible_cached = fin.num_cached_tokens
        f.first_token_s = None
        f.max_out = f.req.max_output_tokens
        f.leg = None
        at_s = now_s + self.transfer_s(moved)
        key = loop.schedule(at_s)
        self._transfers[key] = _Transfer(f, prefill_idx, leg.decode_idx, at_s)

    def transfer_done(self, loop: _Loop, key: int, now_s: float) -> None:
        """A transfer ended: free the prefill side, install the blocks, submit the decode leg."""
        t = self._transfers.pop(key)
        f = t.flight
        _engine(loop, t.prefill_idx).release_hold(f.req.request_id)
        decode = loop.workers[t.decode_idx]
        installed = _engine(loop, t.decode_idx).install_blocks(f.req.request_id, f.hashes)
        if loop.config.kv_events:
            loop.kv_events(decode, installed, now_s)
        n = f.route.n_prompt_tokens
        request = self.make_request(f.req.request_id, n, f.req.max_output_tokens, f.hashes, n)
        loop.submit(t.decode_idx, f, request, now_s)

    def horizon_s(self, loop: _Loop, idx: int) -> float:
        """Until when worker `idx` may coalesce decode steps: a decode worker only until new
        work could reach it (a transfer's end, or a prefill worker's step end, which may start
        one); a prefill worker gets work only from arrivals. In a pool of mixed workers any worker
        may run a prefill leg, so the step ends that count are those of the workers running one."""
        if idx < self.n_prefill:
            return math.inf
        horizon = min((t.at_s for t in self._transfers.values()), default=math.inf)
        legs = self._legs if self.mixed else range(self.n_prefill)
        for j in legs:
            pending = loop.workers[j].pending
            if pending is not None:
                horizon = min(horizon, pending.end_s)
        return horizon


def _engine(loop: _Loop, idx: int) -> PdEngine:
    return cast(PdEngine, loop.workers[idx].engine)
