"""A reloaded policy takes over what the one it replaces learned (`PrefixPolicyBase.carry_over`):
the pools' indexes and calibration where they are sized and keyed as before, the running
requests' salts, the promoted public prefixes and the sync bookkeeping; nothing otherwise."""

from __future__ import annotations

from policies.base import KvEvent, KvEventKind, Observation, RouteRequest, RoutingPolicy, WorkerId, WorkerView
from policies.config import build_policy, parse_policy_yaml
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerHolding
from policies.pools import CarriesLearning
from policies.prefix_policy import PrefixPolicyBase
from prompt_normalizer.types import PUBLIC_NAMESPACE
from tests.policies.factories import req, workers
from tests.policies.test_prefix_baselines import BS, _event_chain, _hasher, _with_keys

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


def test_the_namespaces_index_shares_hold_until_their_tenants_next_request() -> None:
    # Taken over without them, a peer's holding in a tenant's namespace, arriving before that
    # tenant's next request, trimmed the holdings to the default share.
    text = (
        "policy: cost\ndefault_pool: {index: {max_entries: 400, namespace_share: 0.1}}\n"
        "tenants: {t: {index_share: 1.0}}\n"
    )
    old = _policy(text)
    wide = [WorkerView(WorkerId(f"w{i}"), num_gpu_blocks=100_000) for i in range(2)]
    for i in range(8):
        r = req(f"r{i}", range(i * 1000, i * 1000 + 20))
        d = old.select(r, wide, 1.0)
        assert d is not None
        old.on_dispatch(r, d, 1.0)
        old.on_complete(
            Observation(r, d.worker, ttft_s=0.1, prompt_tokens=r.n_prompt_tokens, cached_tokens=0), 1.1
        )
    new = _policy(text)
    assert isinstance(new, CostPolicy) and new.carry_over(old, ["p"]) == ["p"]
    holding = PeerHolding(1, "p", 16, "t", req("z", range(9000, 9002)).block_keys, WorkerId("w0"), 33, 0)
    new.apply_peer("gw2", holding, 2.0)
    index = new._pool(req("x", range(2))).index
    assert index.stats().evictions == 0 and index.stats().keys_by_namespace["t"] >= 160


def test_precise_mode_feeds_go_with_the_index() -> None:
    # The feed maps each worker's engine hashes to our keys: without it, a removal the worker
    # reports after the reload would match nothing, and the index would keep KV the worker dropped.
    hasher = _hasher()
    tokens = list(range(1000, 1000 + 6 * BS))
    keys = _event_chain(hasher, tokens)
    r = _with_keys(req("r", range(6), tenant="pub", namespace=PUBLIC_NAMESPACE), keys)
    views, w1 = workers(0, 0), WorkerId("w1")
    old = CostPolicy(seed=0)
    old.set_token_hasher(hasher)
    old.select(r, views, 0.0)
    old.on_kv_event(
        w1, KvEvent(KvEventKind.BLOCK_STORED, (11, 12, 13, 14), None, tuple(tokens[: 4 * BS]), BS), 1.0
    )
    new = CostPolicy(seed=0)
    assert new.carry_over(old, ["p"]) == ["p"]
    new.set_token_hasher(hasher)  # as the gateway gives it after the swap
    d = new.select(r, views, 2.0)
    assert d is not None and (d.worker, d.matched_tokens) == (w1, 4 * BS)
    new.on_kv_event(w1, KvEvent(KvEventKind.BLOCK_REMOVED, (13, 14)), 3.0)
    d = new.select(r, views, 3.0)
    assert d is not None and (d.worker, d.matched_tokens) == (w1, 2 * BS)


def test_cost_takes_over_the_requests_in_flight_and_the_work_routed_to_each_worker() -> None:
    old = _policy("policy: cost\n")
    w0 = [W[0]]
    for i in range(4):  # four long prompts sent to w0, still running at the reload
        r = req(f"r{i}", range(i * 1000, i * 1000 + 64))
        d = old.select(r, w0, 1.0)
        assert d is not None and d.worker == W[0].worker_id
        old.on_dispatch(r, d, 1.0)
    assert isinstance(old, CostPolicy)
    work = old.recent_work_s(W[0].worker_id, 1.0)
    assert work > 0 and old.uncached_share(W[0].worker_id) == 1.0
    new = _policy("policy: cost\ncost: {epsilon: 0.5, load_window_s: 20}\n")
    assert isinstance(new, CostPolicy)
    new.carry_over(old, ["p"])
    assert new.recent_work_s(W[0].worker_id, 1.0) == work
    assert new.recent_work_s(W[0].worker_id, 21.0) < work / 2  # decayed over the new window
    assert new._ledger.shares == {W[0].worker_id: 1.0}
    # The next new branch goes to the worker the old policy did not load.
    branch = req("b", range(50_000, 50_064))
    d = new.select(branch, W[:2], 1.0)
    assert d is not None and d.worker == W[1].worker_id
    # The running requests leave the taken-over ledger as their outcomes reach the new policy.
    for i in range(4):
        r = req(f"r{i}", range(i * 1000, i * 1000 + 64))
        new.on_complete(
            Observation(r, W[0].worker_id, ttft_s=0.5, prompt_tokens=64 * 16, cached_tokens=0), 2.0
        )
    assert new._ledger.shares == {}
