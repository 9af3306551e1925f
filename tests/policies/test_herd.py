"""Synced gateways deciding at once: the unseen-peer measure, the home shares, the holds, and `cost`'s
use of them."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.herd import (
    HOLD_MARGIN_S,
    HOLD_MAX_LAG_S,
    HOLD_MAX_SHARE,
    HOLD_STEPS_S,
    Gateways,
    UnseenPeers,
    hold_for,
    hold_steps,
    home_workers,
)
from policies.peer_sync import PeerItem
from tests.policies.factories import req, workers

LAG_S = 0.01


@settings(deadline=None)
@given(st.integers(1, 40), st.integers(1, 12))
def test_home_shares_part_the_workers_among_the_gateways(n_workers: int, n_gateways: int) -> None:
    ids = [WorkerId(f"w{i:02d}") for i in range(n_workers)]
    names = [f"gw{g}" for g in range(n_gateways)]
    shares = [home_workers(ids, names, name) for name in names]
    # Every gateway computes the same deal whatever order it lists workers and gateways in.
    assert shares == [home_workers(ids[::-1], names[::-1], name) for name in names]
    assert all(len(s) >= 1 for s in shares)
    if n_gateways <= n_workers:
        assert set().union(*shares) == set(ids)
        assert sum(map(len, shares)) == n_workers  # disjoint
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        assert all(len(s) == 1 for s in shares)
    assert home_workers(ids, names, "stranger") == frozenset()


def test_gateways_forget_peers_not_heard_within_their_ttl() -> None:
    gws = Gateways("b", ttl_s=10.0)
    gws.heard("a", 0.0)
    gws.heard("c", 5.0)
    ids = [WorkerId(f"w{i}") for i in range(6)]
    assert gws.names(9.0) == ("a", "b", "c")
    assert gws.home(ids, 9.0) == {WorkerId("w1"), WorkerId("w4")}
    assert gws.names(12.0) == ("b", "c")
    assert gws.home(ids, 12.0) == {WorkerId("w0"), WorkerId("w2"), WorkerId("w4")}
    gws.heard("a", 13.0)  # back again
    assert gws.names(13.0) == ("a", "b", "c")
    assert gws.home(ids, 13.0) == {WorkerId("w1"), WorkerId("w4")}


def test_unseen_peers_counts_coincidence_not_rate() -> None:
    steady = UnseenPeers()
    # 100 decisions a second here and 300 from the peers, interleaved, each arriving LAG_S late:
    # about rate × lag of theirs are unseen per decision, in time order.
    events = []
    for k in range(3000):
        t = k / 100
        events.append((t, -1.0))
        events += [(t + j * 0.0025 + LAG_S, t + j * 0.0025) for j in range(1, 4)]
    for at_s, decided_s in sorted(events):
        if decided_s < 0:
            steady.own(at_s)
        else:
            steady.peer(decided_s, at_s)
    assert steady.per_decision == pytest.approx(3.0, rel=0.01)  # 300/s × 10 ms
    quiet = UnseenPeers()
    for k in range(300):  # 10 a second each, peers 25 ms after: none unseen
        quiet.own(k / 10)
        quiet.peer(k / 10 + 0.025, k / 10 + 0.025 + LAG_S)
    assert quiet.per_decision == 0.0
    burst = UnseenPeers()
    for step in range(100):  # every 3 s, 2 requests here and 6 at the peers, all at once
        t = 3.0 * step
        burst.own(t)
        burst.own(t)
        for _ in range(6):
            burst.peer(t, t + LAG_S)
    assert burst.per_decision == pytest.approx(6.0, rel=0.01)


def test_unseen_peers_counts_only_within_its_horizon() -> None:
    unseen = UnseenPeers(window_s=1e9, horizon_s=1.0)  # no decay here
    for k in range(10):
        unseen.own(k * 0.5)
    unseen.peer(0.0, 4.6)  # decided long ago, arrives now: only the decisions of the last second
    assert unseen.per_decision == pytest.approx(2 / 10)
    with pytest.raises(ValueError):
        UnseenPeers(window_s=0)


class Bus:
    """Four `cost` gateways, each publishing to the others; delivery `LAG_S` after a decision."""

    def __init__(self, herd_weight: float, n: int = 4) -> None:
        self.policies = [CostPolicy(seed=g, herd_weight=herd_weight) for g in range(n)]
        self.queue: list[tuple[int, PeerItem, float]] = []
        for g, p in enumerate(self.policies):
            p.set_sync_sink(self._sink(g), origin=f"g{g}")

    def _sink(self, g: int):  # type: ignore[no-untyped-def]
        def sink(item: PeerItem, now_s: float) -> None:
            self.queue.append((g, item, now_s))

        return sink

    def deliver(self) -> None:
        for g, item, decided_s in self.queue:
            for h, p in enumerate(self.policies):
                if h != g:
                    p.apply_peer(f"g{g}", item, decided_s + LAG_S, decided_s)
        self.queue.clear()

    def decide(self, g: int, rid: str, first_block: int, now_s: float, down: int | None = None) -> WorkerId:
        # A new 500-block prompt on 8 workers whose backlogs grow with their index (one of them
        # unhealthy with `down`).
        r = req(rid, range(first_block, first_block + 500))
        views = workers(*[0] * 8, prefill=tuple(2000 * i for i in range(8)))
        if down is not None:
            views[down] = dataclasses.replace(views[down], healthy=False)
        p = self.policies[g]
        decision = p.select(r, views, now_s)
        assert decision is not None
        p.on_dispatch(r, decision, now_s)
        return decision.worker


def _bursts(herd_weight: float, down: int | None = None) -> tuple[Bus, list[list[WorkerId]]]:
    bus = Bus(herd_weight)
    rounds = []
    for k in range(4):  # each gateway gets one new prompt at the same instant, every 3 s
        t = 3.0 * k
        rounds.append([bus.decide(g, f"r{k}-{g}", 10_000 * k + 1000 * g, t, down) for g in range(4)])
        bus.deliver()
    return bus, rounds


def test_gateways_deciding_at_once_part_on_their_home_shares() -> None:
    _, herded = _bursts(herd_weight=0.0)
    assert all(len(set(chosen)) == 1 for chosen in herded)  # the same least-loaded worker, 4 times
    bus, parted = _bursts(herd_weight=2.0)
    assert len(set(parted[0])) == 1  # nothing is known of the peers before their first dispatches
    for chosen in parted[1:]:
        assert len(set(chosen)) == 4
        for g, worker in enumerate(chosen):
            assert int(worker[1:]) % 4 == g  # g's home share: w{g} and w{g+4}
    assert bus.policies[0].stats().counters["herd_home_choices"] >= 2


def test_the_shares_are_dealt_over_the_whole_pool_not_the_candidates() -> None:
    # w1 is down: g1 keeps w5 (its share is {w1, w5}), and nobody's share moves.
    _, parted = _bursts(herd_weight=2.0, down=1)
    for chosen in parted[1:]:
        assert chosen[1] == "w5" and len(set(chosen)) == 4
        assert all(int(worker[1:]) % 4 == g for g, worker in enumerate(chosen))


def test_a_gateway_without_a_name_on_the_bus_keeps_the_winner() -> None:
    bus = Bus(2.0)
    bus.policies[0].set_sync_sink(lambda item, now_s: None, origin="")  # publishes, unnamed
    for k in range(4):
        for g in range(4):
            bus.decide(g, f"r{k}-{g}", 10_000 * k + 1000 * g, 3.0 * k)
        bus.deliver()
    assert "herd_home_choices" not in bus.policies[0].stats().counters
    assert bus.policies[1].stats().counters.get("herd_home_choices", 0) >= 1


def test_a_home_choice_only_ever_replaces_the_winner_by_a_home_worker_matching_as_much() -> None:
    bus = Bus(2.0)
    checked = 0
    for k in range(6):
        for g, p in enumerate(bus.policies):
            # Every other request extends a prompt routed before (a hit somewhere), the rest are new.
            first = 10_000 * (k - 1) + 1000 * g if k % 2 and k else 10_000 * k + 1000 * g
            r = req(f"q{k}-{g}", range(first, first + 500 + 50 * k))
            views = workers(*[0] * 8, prefill=tuple(2000 * i for i in range(8)))
            off = copy.deepcopy(p)
            off.herd_weight = 0.0
            on_d, off_d = p.select(r, views, 3.0 * k), off.select(r, views, 3.0 * k)
            assert on_d is not None and off_d is not None
            if on_d.worker != off_d.worker:
                home = p._gateways.home([v.worker_id for v in views], 3.0 * k)
                assert on_d.worker in home and on_d.matched_tokens >= off_d.matched_tokens
                checked += 1
            p.on_dispatch(r, on_d, 3.0 * k)
        bus.deliver()
    assert checked >= 4  # home choices happened, and each was one


def test_a_steady_stream_routes_as_without_the_home_preference() -> None:
    chosen = {}
    for weight in (0.0, 2.0):
        bus = Bus(weight)
        seq = []
        for k in range(40):  # the gateways take turns, 250 ms apart: every decision sees the others
            t = 0.25 * k
            seq.append(bus.decide(k % 4, f"s{k}", 1000 * k, t))
            bus.deliver()
        chosen[weight] = seq
        assert "herd_home_choices" not in bus.policies[0].stats().counters
    assert chosen[0.0] == chosen[2.0]


def test_herd_weight_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="herd_weight"):
        CostPolicy(herd_weight=-1.0)


@settings(deadline=None)
@given(st.floats(0.0, 100.0), st.floats(0.0, 0.2), st.integers(0, 3))
def test_a_hold_grows_with_the_prefill_and_stays_a_small_share_of_it(
    prefill_s: float, lag_s: float, max_steps: int
) -> None:
    held_s = hold_for(prefill_s, lag_s, max_steps)
    steps = hold_steps(prefill_s, lag_s + HOLD_MARGIN_S, max_steps)
    assert 0 <= steps <= max_steps
    assert steps <= sum(prefill_s >= at_s for at_s in HOLD_STEPS_S)
    assert hold_steps(prefill_s * 2, lag_s + HOLD_MARGIN_S, max_steps) >= steps  # longer waits no less
    if lag_s > HOLD_MAX_LAG_S:
        assert held_s == 0.0
    else:
        assert held_s == pytest.approx(steps * (lag_s + HOLD_MARGIN_S))
    assert held_s <= HOLD_MAX_SHARE * prefill_s + 1e-12


def test_hold_steps_at_a_lag_of_ten_milliseconds() -> None:
    assert [hold_steps(p, 0.011) for p in (0.1, 0.3, 1.5, 10.0)] == [0, 1, 2, 3]
    assert hold_steps(10.0, 0.011, max_steps=1) == 1
    assert hold_steps(0.3, 0.05) == 0  # 50 ms would be a sixth of its prefill
    assert hold_for(10.0, 0.01) == pytest.approx(3 * (0.01 + HOLD_MARGIN_S))


def test_unseen_peers_keeps_the_largest_of_the_last_lags_however_long_it_idles() -> None:
    unseen = UnseenPeers(window_s=30.0)
    assert unseen.lag_s == 0.0
    unseen.peer(1.0, 1.01)
    unseen.peer(2.0, 2.03)
    unseen.peer(3.0, 3.02)
    assert unseen.lag_s == pytest.approx(0.03)
    unseen.peer(300.0, 300.01)  # five minutes idle: the lag is what the link does, not the traffic
    assert unseen.lag_s == pytest.approx(0.03)
    for k in range(UnseenPeers.LAG_SAMPLES):  # the slow one leaves after that many more
        unseen.peer(400.0 + k, 400.01 + k)
    assert unseen.lag_s == pytest.approx(0.01)
    unseen.peer(0.0, 500.0)  # a batch delayed past the horizon counts as the horizon
    assert unseen.lag_s == unseen.horizon_s


def _burst_bus() -> Bus:
    """Four gateways after a few same-instant bursts of new 500-block prompts: in a burst."""
    bus, _ = _bursts(herd_weight=2.0)
    return bus


def test_in_a_burst_a_long_new_prompt_is_held_a_lag_per_step_and_a_short_one_is_not() -> None:
    bus = _burst_bus()
    p = bus.policies[0]
    t = 12.0
    assert p.unseen_peer_dispatches >= 0.5
    long_prompt = req("long", range(900_000, 900_000 + 2000))  # 32k tokens
    short_prompt = req("short", range(800_000, 800_000 + 8))
    cost = p.cost_model(long_prompt)
    assert p._unseen.lag_s == pytest.approx(LAG_S)
    steps = hold_steps(cost.prefill_s(long_prompt.n_prompt_tokens), LAG_S + HOLD_MARGIN_S)
    assert steps >= 2
    assert p.hold_s(long_prompt, t) == pytest.approx(steps * (LAG_S + HOLD_MARGIN_S))
    # However long the gateway idled since, a hold still outlasts the lag.
    assert p.hold_s(long_prompt, t + 60.0) == pytest.approx(steps * (LAG_S + HOLD_MARGIN_S))
    assert p.hold_s(short_prompt, t) == 0.0
    assert p.stats().counters["herd_holds"] == 2
    # What a request finds cached does not need computing: a known prompt's next turn is short.
    views = workers(*[0] * 8)
    decision = p.select(long_prompt, views, t)
    assert decision is not None
    p.on_dispatch(long_prompt, decision, t)
    turn = req("turn", [*range(900_000, 900_000 + 2000), 5, 6])
    assert p.hold_s(turn, t) == 0.0


def test_no_hold_outside_a_burst_without_sync_or_when_switched_off() -> None:
    long_prompt = req("long", range(900_000, 900_000 + 2000))
    alone = CostPolicy()
    assert alone.hold_s(long_prompt, 1.0) == 0.0
    steady = Bus(2.0)
    for k in range(40):  # turns 250 ms apart: every decision sees the others
        steady.decide(k % 4, f"s{k}", 1000 * k, 0.25 * k)
        steady.deliver()
    assert steady.policies[0].hold_s(long_prompt, 10.0) == 0.0
    bus = _burst_bus()
    bus.policies[0].herd_hold_steps = 0
    assert bus.policies[0].hold_s(long_prompt, 12.0) == 0.0
    assert bus.policies[1].hold_s(long_prompt, 12.0) > 0.0
    for bad in (-1, len(HOLD_STEPS_S) + 1):
        with pytest.raises(ValueError, match="herd_hold_steps"):
            CostPolicy(herd_hold_steps=bad)
