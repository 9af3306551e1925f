"""A reloaded policy takes over what the one it replaces learned (`PrefixPolicyBase.carry_over`):
the pools' indexes and calibration where they are sized and keyed as before, the running
requests' salts, the promoted public prefixes and the sync bookkeeping; nothing otherwise."""

from __future__ import annotations

from policies.base import Observation, RouteRequest, RoutingPolicy, WorkerId, WorkerView
from policies.config import build_policy, parse_policy_yaml
from policies.cost_policy import CostPolicy
from policies.pools import CarriesLearning
from policies.prefix_policy import PrefixPolicyBase
from tests.policies.factories import req

W = [WorkerView(WorkerId(f"w{i}")) for i in range(4)]


def _policy(text: str) -> RoutingPolicy:
    return build_policy(parse_policy_yaml(text))


def _served_on_holder(policy: RoutingPolicy, r: RouteRequest, now_s: float) -> WorkerId:
    d = policy.select(r, W, now_s)
    assert d is not None
    policy.on_dispatch(r, d, now_s)
    policy.on_complete(
        Observation(r, d.worker, ttft_s=0.5, prompt_tokens=r.n_prompt_tokens, cached_tokens=0), now_s + 0.5
    )
    return d.worker


def _match(policy: RoutingPolicy, r: RouteRequest, now_s: float) -> tuple[WorkerId | None, int]:
    assert isinstance(policy, PrefixPolicyBase)
    pool = policy._pool(r)
    keys = policy._own_keys(r)
    found = pool.index.lookup(keys.keys, keys.namespace, now_s)
    best = max(found.blocks_by_worker.items(), key=lambda kv: kv[1], default=(None, 0))
    return best[0], best[1]


def test_a_reload_keeps_what_every_worker_holds_and_the_calibration() -> None:
    old = _policy("policy: cost\n")
    holders = {i: _served_on_holder(old, req(f"r{i}", range(i * 1000, i * 1000 + 64)), 1.0) for i in range(6)}
    old_cost = old._pool(req("x", range(2))).cost  # type: ignore[attr-defined]
    new = _policy("policy: cost\ncost: {epsilon: 0.8}\n")
    assert isinstance(new, CarriesLearning)
    assert new.carry_over(old, ["p"]) == ["p"]
    assert new._pool(req("x", range(2))).cost is old_cost  # type: ignore[attr-defined]
    for i, holder in holders.items():
        follow_up = req(f"f{i}", range(i * 1000, i * 1000 + 80))
        d = new.select(follow_up, W, 2.0)
        assert d is not None and d.worker == holder and d.matched_tokens >= 64 * 16


def test_without_the_hand_over_the_new_policy_knows_nothing() -> None:
    old = _policy("policy: cost\n")
    _served_on_holder(old, req("r", range(64)), 1.0)
    new = _policy("policy: cost\n")
    assert _match(new, req("f", range(80)), 2.0) == (None, 0)


def test_pools_keyed_otherwise_or_sized_otherwise_start_afresh() -> None:
    old = _policy("policy: cost\n")
    r = req("r", range(64))
    _served_on_holder(old, r, 1.0)
    other_keys = _policy("policy: cost\n")
    assert other_keys.carry_over(old, []) == []  # type: ignore[attr-defined]
    assert _match(other_keys, r, 2.0) == (None, 0)
    resized = _policy("policy: cost\ndefault_pool: {index: {speculative_ttl_s: 30}}\n")
    assert resized.carry_over(old, ["p"]) == []  # type: ignore[attr-defined]
    assert _match(resized, r, 2.0) == (None, 0)
    recalibrated = _policy("policy: cost\ndefault_pool: {cost_model: {prefill_progress: 1}}\n")
    assert recalibrated.carry_over(old, ["p"]) == ["p"]  # type: ignore[attr-defined]
    assert _match(recalibrated, r, 2.0)[1] == 64
    assert recalibrated._pool(r).cost is not old._pool(r).cost  # type: ignore[attr-defined]


def test_another_kind_of_policy_carries_nothing_either_way() -> None:
    cost = _policy("policy: cost\n")
    _served_on_holder(cost, req("r", range(64)), 1.0)
    plain = _policy("policy: round_robin\n")
    assert not isinstance(plain, CarriesLearning)
    preble = _policy("policy: preble_e2\n")
    assert preble.carry_over(plain, ["p"]) == []  # type: ignore[attr-defined]
    # Between two prefix-aware policies, what the workers hold is the same whoever routes.
    assert preble.carry_over(cost, ["p"]) == ["p"]  # type: ignore[attr-defined]
    assert _match(preble, req("f", range(80)), 2.0)[1] == 64


def test_a_request_running_across_the_reload_confirms_what_it_computed() -> None:
    old = _policy("policy: cost\ndefault_pool: {index: {speculative_ttl_s: 5}}\n")
    r = req("r", range(64))
    d = old.select(r, W, 1.0)
    assert d is not None
    old.on_dispatch(r, d, 1.0)  # speculative holdings, for 5 s unless confirmed
    new = _policy("policy: cost\ndefault_pool: {index: {speculative_ttl_s: 5}}\n")
    assert new.carry_over(old, ["p"]) == ["p"]  # type: ignore[attr-defined]
    new.on_complete(
        Observation(r, d.worker, ttft_s=0.5, prompt_tokens=r.n_prompt_tokens, cached_tokens=0), 1.5
    )
    assert _match(new, req("f", range(80)), 60.0) == (d.worker, 64)  # confirmed: no expiry


def test_the_taken_index_sizes_namespaces_by_the_new_policys_tenants() -> None:
    old = _policy("policy: cost\n")
    _served_on_holder(old, req("r", range(64)), 1.0)
    new = _policy("policy: cost\ntenants: {t: {index_share: 0.25}}\n")
    assert isinstance(new, CostPolicy)
    new.carry_over(old, ["p"])
    new.select(req("s", range(5000, 5010)), W, 2.0)  # notes tenant t's share
    index = new._pool(req("x", range(2))).index
    assert index._namespace_quota("t") == int(index.config.max_entries * 0.25)
