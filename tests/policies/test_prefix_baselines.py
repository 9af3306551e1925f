from __future__ import annotations

import dataclasses
from collections import Counter

from policies import make_policy
from policies.base import KvEvent, KvEventKind, Observation, RouteRequest, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from policies.kv_feed import normalize_engine_hash
from policies.preble import PrebleE2
from policies.sglang_cache_aware import SglangCacheAware
from prompt_normalizer.keys import IdentityTokenHasher, root_key, secret_key
from prompt_normalizer.types import PUBLIC_NAMESPACE, BlockKey, KeyIdentity
from tests.policies.factories import BS, req, workers


def _dispatch(p: object, r: object, views: list[WorkerView], now: float = 0.0) -> str:
    d = p.select(r, views, now)  # type: ignore[attr-defined]
    assert d is not None
    p.on_dispatch(r, d, now)  # type: ignore[attr-defined]
    return str(d.worker)


# -- sglang_cache_aware ------------------------------------------------------------------------------


def test_sglang_sends_every_miss_at_low_load_to_the_first_worker() -> None:
    p = SglangCacheAware()
    picks = [p.select(req(f"r{i}", range(i * 10, i * 10 + 5)), workers(0, 0, 0, 0), 0.0) for i in range(10)]
    assert {d.worker for d in picks if d} == {"w0"}


def test_sglang_follows_the_deepest_match_above_the_threshold_regardless_of_load() -> None:
    p = SglangCacheAware()
    _dispatch(p, req("a", range(10)), [WorkerView(WorkerId("w3"))])
    # 10 of 12 blocks cached (rate 0.83 > 0.3): w3 despite 60 more in flight (under the 64 gate).
    d = p.select(req("b", range(12)), workers(0, 0, 0, 60), 1.0)
    assert d is not None and d.worker == "w3" and d.reason == "cache_hit"
    # 2 of 12 blocks (rate 0.17 <= 0.3): min load, first index.
    d = p.select(req("c", [*range(2), *range(100, 110)]), workers(5, 1, 1, 0), 1.0)
    assert d is not None and d.worker == "w3" and d.reason == "min_load"
    d = p.select(req("c", [*range(2), *range(100, 110)]), workers(5, 1, 1, 3), 1.0)
    assert d is not None and d.worker == "w1"


def test_sglang_imbalance_gate_drops_affinity() -> None:
    p = SglangCacheAware()
    _dispatch(p, req("a", range(10)), [WorkerView(WorkerId("w0"))])
    d = p.select(req("b", range(10)), workers(70, 5, 3), 1.0)
    assert d is not None and d.worker == "w2" and d.reason == "imbalance"
    # 70 − 20 = 50 is within the absolute gate: affinity holds.
    d = p.select(req("b", range(10)), workers(70, 20, 30), 1.0)
    assert d is not None and d.worker == "w0"


def test_sglang_tree_is_size_bounded_per_worker() -> None:
    p = SglangCacheAware(max_tree_size_tokens=4 * BS)
    _dispatch(p, req("a", range(8)), [WorkerView(WorkerId("w0"))])
    assert p.stats().index["p"].entries == 4


# -- preble_e2 -----------------------------------------------------------------------------------------


def test_preble_exploits_when_cached_exceeds_missed_and_explores_otherwise() -> None:
    p = PrebleE2()
    _dispatch(p, req("a", range(10)), [WorkerView(WorkerId("w1"))])
    d = p.select(req("b", range(12)), workers(3, 3, 0), 1.0)
    assert d is not None and d.worker == "w1" and d.reason == "exploit"
    d = p.select(req("c", [*range(3), *range(50, 60)]), workers(3, 3, 0), 1.0)
    assert d is not None and d.worker == "w2" and d.reason == "explore"


def test_preble_load_cost_counts_recent_prefill_and_expires_it() -> None:
    p = PrebleE2(window_s=10.0)
    views = workers(0, 0)
    first = _dispatch(p, req("a", range(200)), views, 0.0)
    second = _dispatch(p, req("b", range(300, 320)), views, 1.0)
    assert second != first  # the first worker carries the big prefill in its window
    p.on_complete(Observation(req("b", range(2)), WorkerId(second), completion_tokens=10), 2.0)
    third = _dispatch(p, req("c", range(400, 600)), views, 30.0)
    assert third in {"w0", "w1"}


# -- the cache-blind baselines ------------------------------------------------------------------------


def test_random_uses_every_worker_and_is_seeded() -> None:
    a = make_policy("random", seed=7)
    b = make_policy("random", seed=7)
    picks_a = [a.select(req(f"r{i}", range(1)), workers(0, 0, 0), 0.0) for i in range(60)]
    picks_b = [b.select(req(f"r{i}", range(1)), workers(0, 0, 0), 0.0) for i in range(60)]
    assert [d.worker for d in picks_a if d] == [d.worker for d in picks_b if d]
    assert len({d.worker for d in picks_a if d}) == 3


def test_consistent_hash_is_sticky_and_bounded() -> None:
    p = make_policy("consistent_hash")
    views = workers(0, 0, 0, 0)
    home = {p.select(req(f"s{i}", range(8), session="user-1"), views, 0.0).worker for i in range(5)}  # type: ignore[union-attr]
    assert len(home) == 1
    (w,) = home
    loaded = [WorkerView(v.worker_id, in_flight_requests=9 if v.worker_id == w else 0) for v in views]
    d = p.select(req("s9", range(8), session="user-1"), loaded, 0.0)
    assert d is not None and d.worker != w and d.reason == "ring_overflow"
    spread = Counter(p.select(req(f"k{i}", range(i * 7, i * 7 + 6)), views, 0.0).worker for i in range(400))  # type: ignore[union-attr]
    assert len(spread) == 4 and min(spread.values()) > 40


def test_consistent_hash_keeps_keys_when_a_worker_joins() -> None:
    p = make_policy("consistent_hash")
    before = {
        i: p.select(req(f"k{i}", range(i * 7, i * 7 + 6)), workers(0, 0, 0), 0.0).worker for i in range(200)
    }  # type: ignore[union-attr]
    after = {
        i: p.select(req(f"k{i}", range(i * 7, i * 7 + 6)), workers(0, 0, 0, 0), 0.0).worker
        for i in range(200)
    }  # type: ignore[union-attr]
    moved = sum(before[i] != after[i] for i in before)
    assert moved < 100 and all(after[i] == "w3" for i in before if before[i] != after[i])


def test_every_policy_reports_stats() -> None:
    from policies import known_policies
    from policies.stats import SupportsStats

    for name in known_policies():
        p = make_policy(name)
        p.select(req("r", range(4)), workers(0, 1), 0.0)
        assert isinstance(p, SupportsStats)
        assert sum(p.stats().decisions_by_reason.values()) == 1


# -- precise mode: KV events ---------------------------------------------------------------------------


def _hasher() -> IdentityTokenHasher:
    """The normalizer's own token-chain hasher for a test identity (what precise mode installs)."""
    identity = KeyIdentity(model_id="m", block_size_tokens=BS, namespace=PUBLIC_NAMESPACE)
    key = secret_key(b"s3cret")
    return IdentityTokenHasher(lambda ident: root_key(key, ident), identity)


def _event_chain(
    hasher: IdentityTokenHasher, tokens: list[int], namespace: str = PUBLIC_NAMESPACE
) -> tuple[BlockKey, ...]:
    prev = hasher.root(namespace, None)
    keys = []
    for i in range(0, len(tokens) - BS + 1, BS):
        prev = hasher.chain(prev, tokens[i : i + BS])
        keys.append(prev)
    return tuple(keys)


def _with_keys(r: RouteRequest, keys: tuple[BlockKey, ...]) -> RouteRequest:
    return dataclasses.replace(r, block_keys=keys)


def test_kv_events_feed_the_index_through_the_dual_key_map() -> None:
    hasher = _hasher()
    p = CostPolicy(seed=0)
    p.set_token_hasher(hasher)
    tokens = list(range(1000, 1000 + 6 * BS))
    keys = _event_chain(hasher, tokens)
    r = _with_keys(req("r", range(6), tenant="pub", namespace=PUBLIC_NAMESPACE), keys)
    views = workers(0, 0)
    p.select(r, views, 0.0)  # tells the policy which pool the workers belong to
    w1 = WorkerId("w1")
    # Two events: blocks 0-3, then 4-5 chained by their engine parent (bytes hash for the second).
    p.on_kv_event(
        w1, KvEvent(KvEventKind.BLOCK_STORED, (11, 12, 13, 14), None, tuple(tokens[: 4 * BS]), BS), 1.0
    )
    parent = (14).to_bytes(32, "big")
    p.on_kv_event(w1, KvEvent(KvEventKind.BLOCK_STORED, (15, 16), parent, tuple(tokens[4 * BS :]), BS), 1.0)
    d = p.select(r, views, 2.0)
    assert d is not None and d.worker == "w1" and d.matched_tokens == 6 * BS
    p.on_kv_event(w1, KvEvent(KvEventKind.BLOCK_REMOVED, (13,)), 3.0)
    d = p.select(r, views, 3.0)
    assert d is not None and (d.worker != "w1" or d.matched_tokens == 2 * BS)
    # A block whose parent was never seen is an orphan, never guessed.
    p.on_kv_event(w1, KvEvent(KvEventKind.BLOCK_STORED, (99,), 12345, tuple(tokens[:BS]), BS), 4.0)
    assert p.stats().counters["kv_event_orphans:p"] == 1
    p.on_kv_event(w1, KvEvent(KvEventKind.ALL_BLOCKS_CLEARED), 5.0)
    assert p.stats().index["p"].entries == 0
    p.check_invariants()


def test_a_salted_chain_is_keyed_under_its_tenants_namespace() -> None:
    hasher = _hasher()
    p = CostPolicy(seed=0)
    p.set_token_hasher(hasher)
    tokens = list(range(3000, 3000 + 4 * BS))
    acme = _with_keys(req("a", range(4), tenant="acme"), _event_chain(hasher, tokens, "acme"))
    public = _with_keys(
        req("p", range(4), tenant="pub", namespace=PUBLIC_NAMESPACE), _event_chain(hasher, tokens)
    )
    views = workers(0, 0, 0, 0)
    p.select(acme, views, 0.0)
    w2 = WorkerId("w2")
    p.on_kv_event(
        w2,
        KvEvent(KvEventKind.BLOCK_STORED, (1, 2), None, tuple(tokens[: 2 * BS]), BS, namespace="acme"),
        1.0,
    )
    # The child event carries no salt (vLLM binds it at the root): it inherits the chain's tenant.
    p.on_kv_event(w2, KvEvent(KvEventKind.BLOCK_STORED, (3, 4), 2, tuple(tokens[2 * BS :]), BS), 1.0)
    d = p.select(acme, views, 2.0)
    assert d is not None and d.worker == "w2" and d.matched_tokens == 4 * BS
    pool = p._pool(acme)
    assert pool.index.lookup(acme.block_keys, "acme", 2.0).blocks_by_worker == {w2: 4}
    # Same tokens, unsalted request in the public namespace: no match on acme's chain.
    assert pool.index.lookup(public.block_keys, PUBLIC_NAMESPACE, 2.0).longest_blocks == 0
    assert p.stats().index["p"].keys_by_namespace == {"acme": 4}
    p.check_invariants()


def test_a_token_id_outside_u32_is_counted_not_raised() -> None:
    p = CostPolicy(seed=0)
    p.set_token_hasher(_hasher())
    p.select(req("r", range(2)), workers(0, 0), 0.0)
    bad = tuple([5] * BS + [-1] + [5] * (BS - 1))
    p.on_kv_event(WorkerId("w0"), KvEvent(KvEventKind.BLOCK_STORED, (1, 2), None, bad, BS), 1.0)
    assert p.stats().counters["kv_event_bad_tokens:p"] == 1
    assert p.stats().index["p"].entries == 1  # block 0 was fine; the chain stops at the bad block
    p.check_invariants()


def test_engine_hash_normalization_matches_the_int_form() -> None:
    digest = bytes(range(32))
    assert normalize_engine_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert normalize_engine_hash(-1) == 2**64 - 1
