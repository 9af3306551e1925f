"""Workers that come and go (`policies.pools.FollowsWorkers`): what the index and the cost policy
keep of a worker ends with the process at its URL, and stays bounded however many come and go."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from policies.base import KvEvent, KvEventKind, Observation, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from policies.index import IndexConfig, PrefixIndex
from policies.pools import FollowsWorkers
from policies.preble import PrebleE2
from policies.prefix_policy import PrefixPolicyBase
from policies.sglang_cache_aware import SglangCacheAware
from prompt_normalizer.keys import IdentityTokenHasher, root_key, secret_key
from prompt_normalizer.types import PUBLIC_NAMESPACE, KeyIdentity
from tests.policies.factories import BS, chain, req

W0, W1 = WorkerId("w0"), WorkerId("w1")


def test_a_retired_worker_records_nothing_until_it_joins_again() -> None:
    idx = PrefixIndex(IndexConfig(default_capacity_tokens=100 * BS), BS)
    keys = chain("t", range(6))
    idx.set_capacity(W0, 50 * BS)
    idx.record(keys, W0, "t", 0.0, speculative=True)
    idx.record(keys, W1, "t", 0.0, speculative=False)
    idx.retire_worker(W0)
    assert idx.lookup(keys, "t", 1.0).blocks_by_worker == {W1: 6}
    # What still comes of it (a request it finishes, a KV event, a capacity) is not recorded.
    assert idx.record(keys, W0, "t", 2.0, speculative=False) == 0
    idx.confirm(keys, W0, "t", 2.0)
    idx.record_key(keys[0], W0, "t", 2.0)
    idx.set_capacity(W0, 10 * BS)
    idx.clear_worker(W0)
    assert idx.entries_of(W0) == 0 and idx.stats().workers == 1
    idx.check_invariants()
    idx.admit_worker(W0)  # back: a process the index knows nothing of, with the default capacity
    assert idx.capacity_blocks(W0) == 100 and idx.entries_of(W0) == 0
    idx.record(keys[:2], W0, "t", 3.0, speculative=True)
    assert idx.lookup(keys, "t", 3.0).blocks_by_worker == {W0: 2, W1: 6}
    idx.check_invariants()


def test_joining_forgets_what_was_known_of_the_url() -> None:
    idx = PrefixIndex(IndexConfig(), BS)
    keys = chain("t", range(4))
    idx.record(keys, W0, "t", 0.0, speculative=False)
    idx.admit_worker(W0)  # a pod given the address of one the index still remembers
    assert idx.lookup(keys, "t", 1.0).longest_blocks == 0
    idx.check_invariants()


def test_retired_workers_are_bounded_by_max_workers() -> None:
    idx = PrefixIndex(IndexConfig(max_workers=8, max_entries=1000), BS)
    for i in range(100):
        worker = WorkerId(f"pod-{i}")
        idx.record(chain("t", range(i, i + 3)), worker, "t", float(i), speculative=False)
        idx.retire_worker(worker)
        idx.check_invariants()
    assert len(idx._gone) == 8 and idx.stats().workers == 0 and idx.stats().keys == 0
    # The oldest retired ones fell out of the bound: a late record of one of them is taken.
    assert idx.record(chain("t", range(3)), WorkerId("pod-0"), "t", 200.0, speculative=False) == 0
    assert idx.entries_of(WorkerId("pod-0")) == 3


def _served(p: PrefixPolicyBase, rid: str, blocks: range, views: list[WorkerView], now_s: float) -> WorkerId:
    r = req(rid, blocks)
    d = p.select(r, views, now_s)
    assert d is not None
    p.on_dispatch(r, d, now_s)
    p.on_complete(Observation(r, d.worker, ttft_s=0.1, prompt_tokens=r.n_prompt_tokens), now_s)
    return d.worker


def test_the_cost_policy_forgets_a_worker_that_leaves_and_ignores_its_late_completions() -> None:
    p = CostPolicy(seed=0)
    assert isinstance(p, FollowsWorkers)
    views = [WorkerView(W0)]
    assert _served(p, "a", range(8), views, 0.0) == W0
    late = req("b", range(100, 108))
    d = p.select(late, views, 1.0)
    assert d is not None
    p.on_dispatch(late, d, 1.0)
    assert p.recent_work_s(W0, 1.0) > 0
    p.worker_left("p", W0)
    assert p.stats().index["p"].workers == 0 and p.recent_work_s(W0, 1.0) == 0
    p.on_complete(Observation(late, W0, ttft_s=0.1, prompt_tokens=late.n_prompt_tokens), 2.0)
    assert p.stats().index["p"].entries == 0  # it finished there after leaving: nothing learned
    p.worker_joined("p", W0)
    assert _served(p, "c", range(8), views, 3.0) == W0
    assert p.stats().index["p"].entries == 8
    p.check_invariants()


@pytest.mark.parametrize("make", [SglangCacheAware, PrebleE2])
def test_the_baselines_forget_a_worker_that_leaves(make: Callable[..., PrefixPolicyBase]) -> None:
    p = make(seed=0)
    assert isinstance(p, FollowsWorkers)
    views = [WorkerView(W0)]
    assert _served(p, "a", range(8), views, 0.0) == W0
    assert p.stats().index["p"].entries == 8
    p.worker_left("p", W0)
    assert p.stats().index["p"].workers == 0
    if isinstance(p, PrebleE2):
        assert W0 not in p._window and W0 not in p._window_sum
    p.worker_joined("p", W0)
    _served(p, "b", range(8), views, 1.0)
    p.worker_reset("p", W0)
    assert p.stats().index["p"].entries == 0
    p.check_invariants()


def test_a_reset_clears_holdings_and_keeps_capacity() -> None:
    p = CostPolicy(seed=0)
    views = [WorkerView(W0, num_gpu_blocks=40, engine_block_size=BS)]
    _served(p, "a", range(8), views, 0.0)
    pool = p._pools.existing("p")
    assert pool is not None and pool.index.capacity_blocks(W0) == 36  # 40 blocks × 0.9
    p.worker_reset("p", W0)
    assert pool.index.entries_of(W0) == 0 and pool.index.capacity_blocks(W0) == 36
    assert p.recent_work_s(W0, 0.0) == 0
    p.check_invariants()


def _hasher() -> IdentityTokenHasher:
    identity = KeyIdentity(model_id="m", block_size_tokens=BS, namespace=PUBLIC_NAMESPACE)
    key = secret_key(b"s3cret")
    return IdentityTokenHasher(lambda ident: root_key(key, ident), identity)


def _stored(hashes: tuple[int, ...], parent: int | None, tokens: list[int]) -> KvEvent:
    return KvEvent(KvEventKind.BLOCK_STORED, hashes, parent, tuple(tokens), BS)


def test_kv_event_maps_go_with_a_worker_that_leaves_and_stay_through_a_reset() -> None:
    """The engine-hash map says how the engine's hashes translate, not what the worker holds: a
    worker whose holdings were cleared by health checks may be the same engine, which goes on
    extending the chains it had, so its next blocks are placed; one that left is not followed."""
    p = CostPolicy(seed=0)
    p.set_token_hasher(_hasher())
    tokens = list(range(1000, 1000 + 6 * BS))
    p.select(req("r", range(1)), [WorkerView(W1)], 0.0)  # tells the policy the worker's pool
    p.on_kv_event(W1, _stored((11, 12, 13, 14), None, tokens[: 4 * BS]), 1.0)
    assert p.stats().index["p"].entries == 4
    p.worker_reset("p", W1)
    assert p.stats().index["p"].entries == 0
    p.on_kv_event(W1, _stored((15,), 14, tokens[4 * BS : 5 * BS]), 2.0)
    assert p.stats().index["p"].entries == 1 and p.stats().counters["kv_event_orphans:p"] == 0
    p.worker_left("p", W1)
    p.on_kv_event(W1, _stored((16,), 15, tokens[5 * BS :]), 3.0)  # in flight when it left
    assert p.stats().index["p"].workers == 0
    p.worker_joined("p", W1)
    p.on_kv_event(W1, _stored((16,), 15, tokens[5 * BS :]), 4.0)  # its parent is another process's
    assert p.stats().index["p"].entries == 0 and p.stats().counters["kv_event_orphans:p"] == 1
    p.check_invariants()


def test_nothing_grows_with_workers_that_come_and_go() -> None:
    """Two thousand pods (twice the index's bound on workers), each given a new address, serve a
    request and leave with another still running (it finishes later, and a KV event of theirs
    arrives late), while two workers stay: what the policy keeps per worker stays at the live
    workers (and the bounded list of departed ones)."""
    p = CostPolicy(seed=0)
    p.set_token_hasher(_hasher())
    stay = [WorkerView(WorkerId("stay-0")), WorkerView(WorkerId("stay-1"))]
    tokens = list(range(5000, 5000 + BS))
    now = 0.0
    for i in range(2_000):
        pod = WorkerId(f"http://10.1.{i // 250}.{i % 250}:8000")
        p.worker_joined("p", pod)
        views = [*stay, WorkerView(pod)]
        _served(p, f"a{i}", range(i * 4, i * 4 + 4), views, now)
        running = req(f"b{i}", range(i * 4 + 1, i * 4 + 5))
        d = p.select(running, views, now)
        assert d is not None
        p.on_dispatch(running, d, now)
        p.on_kv_event(pod, _stored((i,), None, tokens), now)
        p.worker_left("p", pod)
        p.on_complete(Observation(running, d.worker, ttft_s=0.1, prompt_tokens=running.n_prompt_tokens), now)
        p.on_kv_event(pod, _stored((i + 1,), i, tokens), now)
        now += 0.5
    pool = p._pools.existing("p")
    assert pool is not None
    stats = p.stats().index["p"]
    assert stats.workers <= 2  # the two that stay: every holding is a member's
    assert len(pool.index._gone) == pool.index.config.max_workers
    assert len(pool._capacity_seen) <= 2 + 4 * pool.index.config.max_workers  # its own bound
    assert len(p._recent_work.by_worker) <= 2 and len(p._feeds["p"]._maps) == 0
    assert len(p._ledger._inflight) == 0 and len(p._dispatched) == 0
    p.check_invariants()
