from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import WorkerId
from policies.index import IndexConfig, PrefixIndex
from tests.policies.factories import BS, chain

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")


def _index(**kw: object) -> PrefixIndex:
    return PrefixIndex(IndexConfig(**kw), BS)  # type: ignore[arg-type]


def test_one_pass_lookup_gives_every_workers_matched_length() -> None:
    idx = _index()
    keys = chain("t", range(10))
    idx.record(keys, W0, "t", 0.0, speculative=False)
    idx.record(keys[:4], W1, "t", 0.0, speculative=False)
    idx.record(chain("t", [99, 1, 2]), W2, "t", 0.0, speculative=False)
    m = idx.lookup(keys, "t", 1.0)
    assert dict(m.blocks_by_worker) == {W0: 10, W1: 4}
    assert m.longest_blocks == 10 and m.deepest_holder == W0
    idx.record(keys[:2], W0, "t", 7.5, speculative=False)
    assert idx.last_use_s(keys[0], W0) == 7.5 and idx.last_use_s(keys[5], W0) == 0.0
    assert idx.last_use_s(keys[5], W1) is None
    idx.check_invariants()


def test_a_fresh_confirmed_chain_is_not_walked_again() -> None:
    idx = _index(recency_resolution_s=1.0)
    keys = chain("t", range(6))
    assert idx.record(keys, W0, "t", 0.0, speculative=False) == 0
    other = chain("t", [50, 51])
    idx.record(other, W0, "t", 0.2, speculative=False)
    # Touched 0.5 s ago and confirmed: nothing changes, not even its recency.
    assert idx.record(keys, W0, "t", 0.5, speculative=True) == 0
    assert idx.last_use_s(keys[0], W0) == 0.0 and idx.holds(keys[5], W0, 100.0)
    # Past the resolution the chain is walked and becomes the most recent again.
    assert idx.record(keys, W0, "t", 1.5, speculative=True) == 0
    assert idx.last_use_s(keys[0], W0) == 1.5 and idx.last_use_s(other[0], W0) == 0.2
    # A chain that extends it is walked whole: new blocks are speculative, the rest refreshed.
    longer = chain("t", range(8))
    assert idx.record(longer, W0, "t", 1.6, speculative=True) == 2
    assert idx.last_use_s(keys[0], W0) == 1.6
    idx.check_invariants()


def test_confirm_flips_speculative_blocks_in_place_and_restores_lost_ones() -> None:
    idx = _index(recency_resolution_s=1.0, speculative_ttl_s=5.0)
    base = chain("t", range(4))
    idx.record(base, W0, "t", 0.0, speculative=False)
    longer = chain("t", range(7))
    assert idx.record(longer, W0, "t", 10.0, speculative=True) == 3
    idx.confirm(longer, W0, "t", 11.0)
    assert idx.stats().speculative_entries == 0
    assert idx.last_use_s(longer[6], W0) == 10.0  # recency stays where the dispatch put it
    # A speculative block that expired while the request ran is recorded again, and the whole
    # chain with it, so the worker's list stays prefix-closed (block 0 most recent).
    again = chain("t", range(9))
    assert idx.record(again, W0, "t", 20.0, speculative=True) == 2
    idx.expire(26.0)
    assert not idx.holds(again[8], W0, 26.0)
    idx.confirm(again, W0, "t", 26.0)
    assert idx.holds(again[8], W0, 26.0) and idx.last_use_s(again[0], W0) == 26.0
    assert idx.lookup(again, "t", 26.0).blocks(W0) == 9
    idx.check_invariants()


def test_lookup_never_skips_a_missing_middle_block() -> None:
    idx = _index()
    keys = chain("t", range(6))
    idx.record(keys, W0, "t", 0.0, speculative=False)
    assert idx.remove(keys[2], W0)
    assert idx.lookup(keys, "t", 0.0).blocks(W0) == 2
    idx.check_invariants()


def test_capacity_evicts_tail_first_and_forgets_old_prefixes() -> None:
    idx = _index(default_capacity_tokens=6 * BS)
    a, b = chain("t", range(4)), chain("t", range(100, 104))
    idx.record(a, W0, "t", 0.0, speculative=False)
    idx.record(b, W0, "t", 1.0, speculative=False)
    # 8 blocks into 6 slots: the two least recent go, and those are a's tail blocks.
    assert idx.lookup(b, "t", 2.0).blocks(W0) == 4
    assert idx.lookup(a, "t", 2.0).blocks(W0) == 2
    assert idx.stats().evictions == 2
    long = chain("t", range(200, 220))
    idx.record(long, W0, "t", 3.0, speculative=False)
    assert idx.lookup(long, "t", 3.0).blocks(W0) == 6  # the head of a too-long prompt survives
    idx.check_invariants()


@pytest.mark.parametrize("granularity", [1, 2])
def test_a_chain_longer_than_the_capacity_is_walked_only_as_far_as_it_can_be_held(
    granularity: int,
) -> None:
    def filled() -> PrefixIndex:
        idx = _index(default_capacity_tokens=6 * BS * granularity, granularity_blocks=granularity)
        idx.record(chain("t", range(100, 104)), W0, "t", 0.0, speculative=False)
        return idx

    long = chain("t", range(200, 200 + 40 * granularity))
    walked, reference = filled(), filled()
    walked.record(long, W0, "t", 1.0, speculative=True)
    walked.confirm(long, W0, "t", 2.0)
    reference.record(long[: 6 * granularity], W0, "t", 1.0, speculative=True)
    reference.confirm(long[: 6 * granularity], W0, "t", 2.0)
    # The same holdings as recording only the head, and no block put in only to be evicted.
    for idx in (walked, reference):
        assert idx.lookup(long, "t", 2.0).blocks(W0) == 6 * granularity
        assert idx.stats() == reference.stats()
        assert idx.stats().evictions == 4 // granularity  # b made room (its entries)
        assert idx.stats().speculative_entries == 0
        idx.check_invariants()


def test_reported_capacity_shrinks_the_worker() -> None:
    idx = _index()
    keys = chain("t", range(10))
    idx.record(keys, W0, "t", 0.0, speculative=False)
    idx.set_capacity(W0, 3 * BS)
    assert idx.lookup(keys, "t", 0.0).blocks(W0) == 3
    idx.check_invariants()


def test_speculative_entries_expire_unless_confirmed() -> None:
    idx = _index(speculative_ttl_s=10.0)
    a, b = chain("t", range(3)), chain("t", range(50, 53))
    idx.record(a, W0, "t", 0.0, speculative=True)
    idx.record(b, W0, "t", 0.0, speculative=True)
    idx.record(b, W0, "t", 5.0, speculative=False)  # confirmed by feedback
    assert idx.lookup(a, "t", 9.0).blocks(W0) == 3
    assert idx.lookup(a, "t", 10.5).blocks(W0) == 0  # ignored once past its TTL, even before expire()
    idx.expire(10.5)
    assert idx.stats().expirations == 3 and idx.stats().speculative_entries == 0
    assert idx.lookup(b, "t", 1000.0).blocks(W0) == 3
    idx.record(b, W0, "t", 1000.0, speculative=True)  # never downgrades a confirmed holding
    idx.expire(5000.0)
    assert idx.lookup(b, "t", 5000.0).blocks(W0) == 3
    idx.check_invariants()


def test_refreshed_speculative_entry_lives_on() -> None:
    idx = _index(speculative_ttl_s=10.0)
    a = chain("t", range(2))
    idx.record(a, W0, "t", 0.0, speculative=True)
    idx.record(a, W0, "t", 8.0, speculative=True)
    idx.expire(12.0)
    assert idx.lookup(a, "t", 12.0).blocks(W0) == 2
    idx.expire(18.0)
    assert idx.lookup(a, "t", 18.0).blocks(W0) == 0
    idx.check_invariants()


def test_a_key_filed_under_another_namespace_is_a_miss() -> None:
    idx = _index()
    keys = chain("alice", range(4))
    idx.record(keys, W0, "alice", 0.0, speculative=False)
    # Same 64-bit keys presented under another namespace (a collision): never shared.
    assert idx.lookup(keys, "bob", 0.0).longest_blocks == 0
    idx.record(keys, W1, "bob", 0.0, speculative=False)
    assert idx.lookup(keys, "alice", 0.0).blocks(W1) == 0
    idx.check_invariants()


def test_namespace_quota_bounds_one_tenant() -> None:
    idx = PrefixIndex(IndexConfig(max_entries=1000), BS, lambda ns: 0.01 if ns == "greedy" else 0.5)
    for i in range(50):
        idx.record(chain("greedy", range(i * 10, i * 10 + 5)), W0, "greedy", float(i), speculative=False)
    idx.record(chain("calm", range(5)), W0, "calm", 60.0, speculative=False)
    per_ns = idx.stats().keys_by_namespace
    assert per_ns["greedy"] == 10 and per_ns["calm"] == 5
    idx.check_invariants()


def test_coarser_granularity_indexes_every_gth_key() -> None:
    idx = _index(granularity_blocks=4)
    keys = chain("t", range(10))
    idx.record(keys, W0, "t", 0.0, speculative=False)
    assert idx.stats().keys == 2
    assert idx.lookup(keys, "t", 0.0).blocks(W0) == 8
    assert idx.lookup(keys[:7], "t", 0.0).blocks(W0) == 4


def test_clear_worker_keeps_capacity_and_other_workers() -> None:
    idx = _index(default_capacity_tokens=100 * BS)
    keys = chain("t", range(5))
    idx.set_capacity(W0, 4 * BS)
    idx.record(keys, W0, "t", 0.0, speculative=False)
    idx.record(keys, W1, "t", 0.0, speculative=False)
    idx.clear_worker(W0)
    assert idx.lookup(keys, "t", 0.0).blocks_by_worker == {W1: 5}
    assert idx.capacity_blocks(W0) == 4
    idx.check_invariants()


def test_flood_of_unique_prefixes_stays_bounded() -> None:
    idx = _index(max_entries=2000, speculative_ttl_s=1e9, namespace_share=1.0)
    workers = [WorkerId(f"w{i}") for i in range(4)]
    for i in range(3000):
        idx.record(chain("t", range(i * 8, i * 8 + 8)), workers[i % 4], "t", float(i), speculative=True)
    s = idx.stats()
    assert s.entries <= 2000 and s.keys <= 2000
    assert len(idx._spec_expiry) <= 2000
    # The most recent prefixes are still there.
    assert idx.lookup(chain("t", range(2999 * 8, 2999 * 8 + 8)), "t", 3000.0).blocks(workers[3]) == 8
    idx.check_invariants()


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="granularity"):
        IndexConfig(granularity_blocks=0)
    with pytest.raises(ValueError, match="namespace_share"):
        IndexConfig(namespace_share=0.0)


# -- property test: random operations against a naive model ---------------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["spec", "conf", "confirm", "remove", "expire", "clear", "cap", "retire", "admit"]),
        st.integers(0, 2),  # worker
        st.integers(0, 5),  # which prefix family
        st.integers(1, 6),  # length in blocks
        st.integers(0, 3),  # time step
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@given(_ops)
def test_random_operations_keep_invariants_and_match_a_naive_walk(
    ops: list[tuple[str, int, int, int, int]],
) -> None:
    idx = PrefixIndex(
        IndexConfig(
            default_capacity_tokens=8 * BS, max_entries=20, speculative_ttl_s=3.0, namespace_share=0.8
        ),
        BS,
    )
    workers = [WorkerId(f"w{i}") for i in range(3)]
    families = [chain("t", [f * 1000 + j if j >= f else j for j in range(6)]) for f in range(6)]
    now = 0.0
    for op, w, fam, length, dt in ops:
        now += dt
        keys = families[fam][:length]
        worker = workers[w]
        if op == "spec":
            idx.record(keys, worker, "t", now, speculative=True)
        elif op == "conf":
            idx.record(keys, worker, "t", now, speculative=False)
        elif op == "confirm":
            idx.confirm(keys, worker, "t", now)
        elif op == "remove":
            idx.remove(keys[-1], worker)
        elif op == "expire":
            idx.expire(now)
        elif op == "clear":
            idx.clear_worker(worker)
        elif op == "retire":
            idx.retire_worker(worker)
        elif op == "admit":
            idx.admit_worker(worker)
        else:
            idx.set_capacity(worker, length * BS)
        idx.check_invariants()
        if idx.retired(worker):
            assert idx.entries_of(worker) == 0
        probe = families[(fam + 1) % 6]
        got = idx.lookup(probe, "t", now)
        for wk in workers:
            naive = 0
            while naive < len(probe) and idx.holds(probe[naive], wk, now):
                naive += 1
            assert got.blocks(wk) == naive


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["spec", "conf", "confirm", "expire", "clear", "cap"]),
            st.integers(0, 3),
            st.integers(0, 7),
            st.integers(1, 12),
            st.integers(0, 2),
        ),
        max_size=80,
    ),
    st.integers(1, 3),
)
@pytest.mark.slow
def test_bisection_lookup_equals_the_block_by_block_walk(
    ops: list[tuple[str, int, int, int, int]], granularity: int
) -> None:
    # No explicit removals: every worker stays prefix-closed, so lookups take the bisection path.
    idx = PrefixIndex(
        IndexConfig(
            default_capacity_tokens=30 * BS,
            max_entries=90,
            speculative_ttl_s=2.5,
            granularity_blocks=granularity,
        ),
        BS,
    )
    workers = [WorkerId(f"w{i}") for i in range(4)]
    # Eight chains that share prefixes of different lengths (a small tree).
    families = [chain("t", [j if j < f + 2 else f * 100 + j for j in range(12)]) for f in range(8)]
    now = 0.0
    for op, w, fam, length, dt in ops:
        now += dt
        worker = workers[w]
        if op in ("spec", "conf"):
            idx.record(families[fam][:length], worker, "t", now, speculative=op == "spec")
        elif op == "confirm":
            idx.confirm(families[fam][:length], worker, "t", now)
        elif op == "expire":
            idx.expire(now)
        elif op == "clear":
            idx.clear_worker(worker)
        else:
            idx.set_capacity(worker, length * BS * granularity)
        idx.check_invariants()
        assert not idx._open
        for probe in families:
            got = idx.lookup(probe, "t", now)
            coarse = probe[granularity - 1 :: granularity]
            for wk in workers:
                naive = 0
                while naive < len(coarse) and idx.holds(coarse[naive], wk, now):
                    naive += 1
                assert got.blocks(wk) == naive * granularity


def test_refreshing_speculative_holdings_keeps_one_expiry_record_each() -> None:
    idx = _index(max_entries=64, speculative_ttl_s=10.0)
    keys = chain("t", range(8))
    for t in range(1000):
        idx.record(keys, W0, "t", float(t) * 0.01, speculative=True)
    assert len(idx._spec_expiry) == 8
    idx.expire(9.98 + 9.9)
    assert idx.lookup(keys, "t", 19.88).blocks(W0) == 8  # the last refresh counts
    idx.expire(9.99 + 10.0)
    assert idx.lookup(keys, "t", 20.0).longest_blocks == 0 and not idx._spec_expiry
    idx.check_invariants()


def test_a_new_worker_shrinks_everyone_to_the_smaller_share_only_when_needed() -> None:
    idx = _index(max_entries=100, default_capacity_tokens=1000 * BS, namespace_share=1.0)
    idx.record(chain("t", range(40)), W0, "t", 0.0, speculative=False)
    idx.record(chain("t", range(40)), W1, "t", 0.0, speculative=False)
    assert idx.entries_of(W0) == 40  # share 50 each: nothing to trim
    idx.record(chain("u", range(5)), WorkerId("w2"), "u", 1.0, speculative=False)
    # Share is now 33: the two long lists lose their tails, heads stay.
    assert idx.entries_of(W0) == 33 and idx.entries_of(W1) == 33
    assert idx.lookup(chain("t", range(40)), "t", 1.0).blocks_by_worker == {W0: 33, W1: 33}
    idx.check_invariants()


def test_drop_speculative_keeps_confirmed_holdings() -> None:
    idx = _index()
    keys = chain("t", range(10))
    idx.record(keys, W0, "t", 0.0, speculative=False, n_blocks=4)
    idx.record(keys, W0, "t", 0.0, speculative=True)
    assert idx.drop_speculative(keys, W0, "t") == 6
    assert idx.drop_speculative(keys, W0, "other") == 0
    assert idx.lookup(keys, "t", 0.0).blocks(W0) == 4
    idx.check_invariants()
