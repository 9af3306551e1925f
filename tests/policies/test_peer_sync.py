"""Replica sync on the policy side: what a policy publishes and what a peer does with it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import (
    Isolation,
    Observation,
    Outcome,
    Role,
    RouteDecision,
    RouteRequest,
    WorkerId,
    WorkerView,
)
from policies.cost_policy import CostPolicy
from policies.index import IndexConfig
from policies.peer_sync import (
    PeerCalibration,
    PeerHolding,
    PeerItem,
    PeerLoad,
    PeerLoads,
    PeerOutcome,
    PeerRouting,
    SupportsPeerSync,
    with_peer_load,
)
from policies.pools import PoolSettings
from policies.prefix_policy import SharedSettings
from tests.policies.factories import BS, req, workers

W0, W1 = WorkerId("w0"), WorkerId("w1")


def _policy(ttl_s: float = 60.0, capacity_tokens: int = 430_000, seed: int = 1) -> CostPolicy:
    index = IndexConfig(speculative_ttl_s=ttl_s, default_capacity_tokens=capacity_tokens)
    shared = SharedSettings(default_pool=PoolSettings(index=index))
    return CostPolicy(seed=seed, shared=shared)


class Outbox:
    """A sink that keeps what a policy published."""

    def __init__(self) -> None:
        self.items: list[tuple[PeerItem, float]] = []

    def __call__(self, item: PeerItem, now_s: float) -> None:
        self.items.append((item, now_s))

    def deliver(self, to: CostPolicy, origin: str = "a", now_s: float | None = None) -> None:
        for item, at_s in self.items:
            to.apply_peer(origin, item, at_s if now_s is None else now_s)
        self.items.clear()


def _dispatch(p: CostPolicy, r: RouteRequest, worker: WorkerId, now_s: float) -> None:
    p.on_dispatch(r, RouteDecision(worker, 0.0, "miss"), now_s)


def test_a_policy_publishes_nothing_until_a_sink_is_set_and_keys_only_then() -> None:
    a = _policy()
    assert isinstance(a, SupportsPeerSync)
    r = req("r0", range(8))
    _dispatch(a, r, W0, 0.0)
    a.on_complete(Observation(r, W0, prompt_tokens=r.n_prompt_tokens), 0.1)
    out = Outbox()
    a.set_sync_sink(out)
    r1 = req("r1", range(8), extra_tokens=5)
    a.on_dispatch(r1, RouteDecision(W1, 0.0, "hit", matched_tokens=3 * BS), 1.0)
    a.on_complete(Observation(r1, W1, prompt_tokens=r1.n_prompt_tokens), 2.0)
    holding, at_s = out.items[0]
    assert at_s == 1.0
    assert holding == PeerHolding(1, "p", BS, "t", r1.block_keys, W1, 8 * BS + 5, 3 * BS)
    assert out.items[1] == (PeerOutcome(1, True), 2.0)
    a.set_sync_sink(None)
    _dispatch(a, req("r2", range(4)), W0, 3.0)
    assert len(out.items) == 2
    # Asked to, it publishes each completion's calibration sample too: sizes only here (no TTFT
    # was observed, so no time ratio).
    a.set_sync_sink(out, calibration=True)
    r3 = req("r3", range(8), extra_tokens=5)
    a.on_dispatch(r3, RouteDecision(W1, 0.0, "hit", matched_tokens=8 * BS), 4.0)
    a.on_complete(Observation(r3, W1, prompt_tokens=r3.n_prompt_tokens), 5.0)
    n = r3.n_prompt_tokens
    assert out.items[-1] == (PeerCalibration("p", BS, n, n, 0.0), 5.0)


def test_a_peer_routes_a_prompt_to_the_worker_the_origin_chose() -> None:
    a, b = _policy(), _policy(seed=7)
    out = Outbox()
    a.set_sync_sink(out)
    first = req("r0", range(64))
    d = a.select(first, workers(0, 0, 0, 0), 0.0)
    assert d is not None
    a.on_dispatch(first, d, 0.0)
    out.deliver(b)
    # The next turn reaches the other gateway while the first is still running.
    again = b.select(req("r1", range(66)), workers(0, 0, 0, 0), 0.1)
    assert again is not None and again.worker == d.worker and again.reason == "hit"
    assert b.stats().counters["peer_holdings_applied"] == 1
    b.check_invariants()


def test_a_peer_holding_expires_like_a_local_speculative_one_unless_served() -> None:
    a, b = _policy(ttl_s=5.0), _policy(ttl_s=5.0)
    out = Outbox()
    a.set_sync_sink(out)
    kept, lost = req("kept", range(10)), req("lost", range(100, 110))
    _dispatch(a, kept, W0, 0.0)
    _dispatch(a, lost, W1, 0.0)
    out.deliver(b)
    index = b._pools.existing("p")
    assert index is not None
    assert index.index.lookup(kept.block_keys, "t", 1.0).blocks(W0) == 10
    a.on_complete(Observation(kept, W0, prompt_tokens=kept.n_prompt_tokens), 2.0)
    out.deliver(b)
    index.index.expire(6.0)
    assert index.index.lookup(kept.block_keys, "t", 6.0).blocks(W0) == 10  # confirmed: no TTL
    assert index.index.lookup(lost.block_keys, "t", 6.0).longest_blocks == 0  # expired
    b.check_invariants()


@pytest.mark.parametrize("outcome", [Outcome.WORKER_FAILED, Outcome.ABORTED, Outcome.REJECTED])
def test_a_failed_dispatch_is_taken_back_by_its_peers(outcome: Outcome) -> None:
    a, b = _policy(), _policy()
    out = Outbox()
    a.set_sync_sink(out)
    r = req("r", range(10))
    _dispatch(a, r, W0, 0.0)
    a.on_complete(Observation(r, W0, outcome=outcome), 0.5)
    out.deliver(b)
    pool = b._pools.existing("p")
    assert pool is not None and pool.index.lookup(r.block_keys, "t", 0.6).longest_blocks == 0
    assert b.stats().counters["peer_outcomes_applied"] == 1
    b.check_invariants()


def test_an_outcome_without_its_holding_and_a_mismatched_block_size_change_nothing() -> None:
    b = _policy()
    b.apply_peer("a", PeerOutcome(9, True), 0.0)
    _dispatch(b, req("own", range(4)), W0, 0.0)
    alien = PeerHolding(1, "p", BS * 2, "t", req("x", range(4)).block_keys, W1, 128, 0)
    b.apply_peer("a", alien, 0.0)
    counters = b.stats().counters
    assert counters["peer_outcomes_unmatched"] == 1 and counters["peer_block_size_mismatch"] == 1
    pool = b._pools.existing("p")
    assert pool is not None and pool.block_size_tokens == BS and pool.index.entries_of(W1) == 0


def test_a_public_dispatch_publishes_the_public_chain() -> None:
    a = _policy()
    out = Outbox()
    a.set_sync_sink(out)
    r = req("r", range(6), isolation=Isolation.PUBLIC, namespace="public")
    _dispatch(a, r, W0, 0.0)
    holding = out.items[0][0]
    # A `public` tenant's request keeps its salt: its keys are re-scoped to the tenant.
    assert isinstance(holding, PeerHolding) and holding.namespace == "public/t"
    assert holding.keys != r.block_keys and len(holding.keys) == 6


def test_a_peers_dispatch_counts_as_work_routed_to_its_worker() -> None:
    a, b = _policy(), _policy()
    out = Outbox()
    a.set_sync_sink(out)
    _dispatch(a, req("r", range(256)), W0, 0.0)
    out.deliver(b)
    assert (
        b.recent_work_s(W0, 0.0) == pytest.approx(a.recent_work_s(W0, 0.0)) and b.recent_work_s(W0, 0.0) > 0
    )


_CHAINS = [range(0, 6), range(0, 9), range(100, 104), range(100, 112), range(200, 203)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, len(_CHAINS) - 1), st.integers(0, 2), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.booleans(),
)
def test_two_gateways_in_lockstep_keep_the_same_index(
    ops: list[tuple[int, int, int, bool]], small: bool
) -> None:
    """Each dispatch and outcome is applied by the peer at once: both indexes see the same
    operations, so (without evictions) they agree on every chain, and invariants hold always."""
    gws = [_policy(ttl_s=5.0, capacity_tokens=6 * BS if small else 430_000) for _ in range(2)]
    outs = [Outbox(), Outbox()]
    for gw, out in zip(gws, outs, strict=True):
        gw.set_sync_sink(out)
    running: dict[str, tuple[int, RouteRequest, WorkerId]] = {}
    for step, (g, chain_i, worker_i, served) in enumerate(ops):
        now_s = step * 0.7
        if running and served:
            rid = next(iter(running))
            origin, r, w = running.pop(rid)
            gws[origin].on_complete(Observation(r, w, prompt_tokens=r.n_prompt_tokens), now_s)
        else:
            r = req(f"r{step}", _CHAINS[chain_i])
            w = WorkerId(f"w{worker_i}")
            _dispatch(gws[g], r, w, now_s)
            running[r.request_id] = (g, r, w)
        for i, out in enumerate(outs):
            out.deliver(gws[1 - i], origin=str(i))
        for p in gws:
            p.check_invariants()
            pool = p._pools.existing("p")
            assert pool is not None
            pool.index.expire(now_s)
        if not small:
            for chain_blocks in _CHAINS:
                keys = req("q", chain_blocks).block_keys
                looks = [p._pools.existing("p").index.lookup(keys, "t", now_s) for p in gws]  # type: ignore[union-attr]
                assert looks[0].blocks_by_worker == looks[1].blocks_by_worker


def test_peer_loads_sum_snapshots_and_forget_a_silent_peer() -> None:
    loads = PeerLoads(ttl_s=3.0)
    assert loads.note("a", [PeerLoad("p", W0, 2, 100, 10)], 0.0, full=False) == {("p", W0)}
    loads.note("b", [PeerLoad("p", W0, 1, 50, 5), PeerLoad("p", W1, 4, 0, 0)], 1.0, full=False)
    assert loads.total("p", W0) == PeerLoad("p", W0, 3, 150, 15) and loads.peers() == 2
    loads.note("a", [PeerLoad("p", W0, 0, 0, 0)], 2.0, full=False)  # idle: dropped
    assert loads.total("p", W0) == PeerLoad("p", W0, 1, 50, 5)
    loads.note("b", [PeerLoad("p", W1, 1, 0, 0)], 2.5, full=True)  # b's whole load: W0 went idle
    assert loads.total("p", W0) is None and loads.total("p", W1) == PeerLoad("p", W1, 1, 0, 0)
    assert loads.expire(5.2) == set() and loads.peers() == 1  # a heard at 2.0: gone; b at 2.5: kept
    assert loads.expire(5.6) == {("p", W1)} and not loads.any and loads.peers() == 0
    loads.check_invariants()


def test_peer_loads_keep_at_most_max_peers_forgetting_the_one_heard_from_least_recently(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(PeerLoads, "MAX_PEERS", 3)
    loads = PeerLoads(ttl_s=60.0)
    for k, origin in enumerate("abc"):
        loads.note(origin, [PeerLoad("p", W0, 1, 10, 1)], float(k), full=False)
    loads.note("a", [], 3.0, full=False)  # heard again: "b" is now the oldest
    assert loads.note("d", [PeerLoad("p", W1, 1, 0, 0)], 4.0, full=False) == {("p", W0), ("p", W1)}
    assert loads.peers() == 3 and not loads.heard_from("b") and loads.heard_from("a")
    assert loads.total("p", W0) == PeerLoad("p", W0, 2, 20, 2)  # b's share went with it
    loads.check_invariants()


def test_peers_holdings_awaiting_outcomes_are_bounded_by_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PeerRouting, "MAX_PENDING_KEYS", 100)
    peers = PeerRouting()
    for ref in range(1, 5):
        peers.remember("a", PeerHolding(ref, "p", BS, "t", req(f"r{ref}", range(30)).block_keys, W0, 30, 0))
        peers.check_invariants()
    assert peers.pending() == (0, 3) and peers.settle("a", 1) is None  # the oldest went first
    assert peers.settle("a", 4) is not None
    peers.remember("a", PeerHolding(9, "p", BS, "t", req("big", range(101)).block_keys, W0, 101, 0))
    assert peers.pending() == (0, 0)  # alone beyond the bound: not kept
    peers.check_invariants()


_FIELDS = ("requests", "prefill_tokens", "decode_tokens")
_LOAD = st.builds(
    PeerLoad,
    st.sampled_from(["p", "q"]),
    st.sampled_from([W0, W1]),
    st.integers(0, 3),
    st.integers(0, 100),
    st.integers(0, 10),
)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]), st.lists(_LOAD, max_size=4), st.booleans(), st.booleans()
        ),
        max_size=30,
    )
)
def test_peer_loads_equal_a_recomputed_model(ops: list[tuple[str, list[PeerLoad], bool, bool]]) -> None:
    loads = PeerLoads(ttl_s=2.0)
    model: dict[str, dict[tuple[str, WorkerId], PeerLoad]] = {}
    heard: dict[str, float] = {}
    for step, (origin, batch, full, expire) in enumerate(ops):
        now_s = float(step)
        if expire:
            loads.expire(now_s)
            for o in [o for o, t in heard.items() if now_s - t >= 2.0]:
                del heard[o]
                model.pop(o, None)
        loads.note(origin, batch, now_s, full=full)
        heard[origin] = now_s
        mine = {} if full else model.get(origin, {})
        for load in batch:
            mine[(load.pool, load.worker)] = load
        model[origin] = mine
        loads.check_invariants()
        for pool in ("p", "q"):
            for w in (W0, W1):
                parts = [m[(pool, w)] for m in model.values() if (pool, w) in m]
                want = tuple(sum(getattr(x, f) for x in parts) for f in _FIELDS)
                got = loads.total(pool, w)
                assert (tuple(getattr(got, f) for f in _FIELDS) if got else (0, 0, 0)) == want


def test_peer_load_weighs_on_the_score_but_not_on_this_gateways_cap() -> None:
    view = WorkerView(W0, in_flight_requests=3, in_flight_prefill_tokens=10, max_in_flight=4)
    assert with_peer_load(view, None) is view
    folded = with_peer_load(view, PeerLoad("p", W0, 5, 1000, 7))
    assert folded == dataclasses.replace(
        view, in_flight_requests=8, in_flight_prefill_tokens=1010, in_flight_decode_tokens=7, max_in_flight=9
    )
    # A policy sees the peers' queue: an idle-looking worker with a peer backlog loses to a quiet one.
    p = _policy()
    views = [folded, WorkerView(W1, in_flight_requests=3, in_flight_prefill_tokens=10, max_in_flight=4)]
    d = p.select(req("r", range(8)), views, 0.0)
    assert d is not None and d.worker == W1


def test_peer_load_keeps_every_field_it_does_not_sum() -> None:
    # A field added to WorkerView must not fall back to its default once a peer's load is folded
    # in (a prefill or decode worker would otherwise score as a mixed one).
    view = WorkerView(
        W0, healthy=False, num_requests_waiting=2, num_requests_running=3, kv_usage=0.5, num_gpu_blocks=9,
        engine_block_size=16, loaded_adapters=frozenset({"a"}), warming=True, role=Role.DECODE,
        in_flight_at_scrape=1, prefill_started_s=4.0,
    )  # fmt: skip
    folded = with_peer_load(view, PeerLoad("p", W0, 1, 0, 0, prefill_since_s=4.0))
    summed = {
        "in_flight_requests", "in_flight_prefill_tokens", "in_flight_decode_tokens", "max_in_flight",
        "decode_context_tokens", "prefill_started_s",
    }  # fmt: skip
    for f in dataclasses.fields(WorkerView):
        if f.name not in summed:
            assert getattr(folded, f.name) == getattr(view, f.name), f.name


def test_a_warm_chain_is_not_published_again_within_the_recency_resolution() -> None:
    a = _policy()
    out = Outbox()
    a.set_sync_sink(out)
    r = req("r", range(8))
    _dispatch(a, r, W0, 0.0)
    a.on_complete(Observation(r, W0, prompt_tokens=r.n_prompt_tokens), 0.2)
    assert len(out.items) == 2
    again = req("r2", range(8))
    _dispatch(a, again, W0, 0.5)  # confirmed and touched 0.5 s ago: the index leaves it be
    a.on_complete(Observation(again, W0, prompt_tokens=again.n_prompt_tokens), 0.6)
    assert len(out.items) == 2
    _dispatch(a, req("r3", range(8)), W0, 1.5)  # past the resolution: walked again, published
    assert len(out.items) == 3 and isinstance(out.items[2][0], PeerHolding)


def _serve(p: CostPolicy, r: RouteRequest, now_s: float, ttft_s: float, engine_unit: int = 4) -> None:
    """Dispatch `r` to W0 and complete it after `ttft_s`, the engine counting `engine_unit` tokens
    per request token (approximate mode)."""
    d = p.select(r, [WorkerView(W0)], now_s)  # the cost model notes what it predicted
    assert d is not None
    p.on_dispatch(r, d, now_s)
    obs = Observation(r, W0, ttft_s=ttft_s, prompt_tokens=engine_unit * r.n_prompt_tokens, cached_tokens=0)
    p.on_complete(obs, now_s + ttft_s)


def test_a_peer_calibrates_from_the_origins_completions_as_the_origin_does() -> None:
    a, b = _policy(), _policy(seed=2)
    out = Outbox()
    a.set_sync_sink(out, calibration=True)
    for i in range(40):
        _serve(a, req(f"r{i}", range(100 * i, 100 * i + 64)), float(i), 0.4)
    samples = [item for item, _ in out.items if isinstance(item, PeerCalibration)]
    assert len(samples) == 40 and all(
        s.scale_ratio > 1.0 and s.prompt_tokens == 4 * s.request_tokens for s in samples
    )
    out.deliver(b)
    mine, theirs = a.cost_model(req("x", range(4))), b.cost_model(req("x", range(4)))
    assert mine.scale > 1.5 and mine.engine_tokens_per_request_token == pytest.approx(4.0)
    assert (theirs.scale, theirs.engine_tokens_per_request_token, theirs.mean_prompt_tokens) == (
        mine.scale, mine.engine_tokens_per_request_token, mine.mean_prompt_tokens,
    )  # fmt: skip
    assert b.stats().counters["peer_calibration_applied"] == 40


def test_two_gateways_that_share_calibrate_alike_from_half_the_completions_each() -> None:
    a, b = _policy(), _policy(seed=2)
    to_b, to_a = Outbox(), Outbox()
    a.set_sync_sink(to_b, calibration=True)
    b.set_sync_sink(to_a, calibration=True)
    for i in range(80):
        # A's half is slow, B's fast: alone each would learn only its own half.
        p, ttft = (a, 0.8) if i % 2 else (b, 0.2)
        _serve(p, req(f"r{i}", range(100 * i, 100 * i + 64)), float(i), ttft)
        to_b.deliver(b)
        to_a.deliver(a)
    sa, sb = a.cost_model(req("x", range(4))).scale, b.cost_model(req("x", range(4))).scale
    assert sa == pytest.approx(sb, rel=0.1)


def test_a_calibration_sample_of_another_block_size_is_not_applied() -> None:
    b = _policy()
    _serve(b, req("r0", range(8)), 0.0, 0.1)
    before = b.cost_model(req("x", range(4))).mean_prompt_tokens
    b.apply_peer("a", PeerCalibration("p", BS * 2, 10_000, 100, 2.0), 1.0)
    assert b.cost_model(req("x", range(4))).mean_prompt_tokens == before
    assert b.stats().counters["peer_block_size_mismatch"] == 1


def test_peers_prefill_pairs_are_summed_and_added_to_the_view() -> None:
    loads = PeerLoads(ttl_s=3.0)
    loads.note("a", [PeerLoad("p", W0, 1, 1000, 10, 0, 500_000)], 0.0, full=False)
    loads.note("b", [PeerLoad("p", W0, 1, 2000, 5, 300, 2_000_000)], 0.5, full=False)
    total = loads.total("p", W0)
    assert total is not None and (total.prefill_pairs, total.decode_context_tokens) == (2_500_000, 300)
    loads.note("b", [PeerLoad("p", W0, 1, 0, 5, 300)], 1.0, full=False)  # b's prompt got its first token
    loads.check_invariants()
    total = loads.total("p", W0)
    assert total is not None and total.prefill_pairs == 500_000
    view = with_peer_load(WorkerView(W0, in_flight_prefill_tokens=10, in_flight_prefill_pairs=50), total)
    assert (view.in_flight_prefill_tokens, view.in_flight_prefill_pairs) == (1010, 500_050)
    loads.note("a", [], 1.5, full=True)
    loads.note("b", [], 1.5, full=True)
    assert loads.total("p", W0) is None
    loads.check_invariants()


def test_peers_decode_contexts_are_summed_and_added_to_the_view() -> None:
    loads = PeerLoads(ttl_s=3.0)
    loads.note("a", [PeerLoad("p", W0, 2, 0, 10, 300_000)], 0.0, full=False)
    loads.note("b", [PeerLoad("p", W0, 1, 50, 5, 100_000)], 0.5, full=False)
    total = loads.total("p", W0)
    assert total is not None and total.decode_context_tokens == 400_000
    loads.note("a", [PeerLoad("p", W0, 1, 0, 5, 120_000)], 1.0, full=False)  # a replaces its snapshot
    loads.check_invariants()
    total = loads.total("p", W0)
    assert total is not None and total.decode_context_tokens == 220_000
    view = with_peer_load(WorkerView(W0, decode_context_tokens=1_000), total)
    assert view.decode_context_tokens == 221_000
    loads.note("a", [], 1.5, full=True)
    loads.note("b", [], 1.5, full=True)
    assert loads.total("p", W0) is None
    loads.check_invariants()
