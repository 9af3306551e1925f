"""Engine model: prefix cache hits, LRU eviction order, salt separation, batching, preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loadtest.engine import (
    Engine,
    EngineConfig,
    EngineQueueFull,
    EngineRejected,
    EngineRequest,
    ProfileError,
    StepResult,
    block_hashes,
    load_profile,
    request_from_tokens,
)
from loadtest.engine.profile import parse_profile

PROFILE = load_profile("llama3-8b-h100")
BS = 16


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


@dataclass
class Run:
    """Everything observed while driving an engine until idle."""

    end_s: float = 0.0
    first_token_s: dict[object, float] = field(default_factory=dict)
    cached: dict[object, int] = field(default_factory=dict)
    finish_s: dict[object, float] = field(default_factory=dict)
    preempted: list[object] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)


def drain(engine: Engine, now_s: float = 0.0, until_s: float | None = None) -> Run:
    run = Run(end_s=now_s)
    for _ in range(100_000):
        res = engine.step(run.end_s, until_s)
        if res is None:
            return run
        engine.check_invariants()
        run.steps.append(res)
        run.end_s = res.end_s
        for ft in res.first_tokens:
            run.first_token_s[ft.request_id] = res.end_s
            run.cached[ft.request_id] = ft.num_cached_tokens
        for fin in res.finished:
            run.finish_s[fin.request_id] = res.end_s
        run.preempted.extend(res.preempted)
        run.removed.extend(res.removed)
        for st in res.stored:
            run.stored.extend(st.block_hashes)
    raise AssertionError("engine did not go idle")


def small_engine(kv_blocks: int, **kw: int) -> Engine:
    return Engine(PROFILE, EngineConfig(kv_blocks=kv_blocks, block_size_tokens=BS, **kw))


def test_isolated_ttft_equals_profile_prefill() -> None:
    engine = Engine(PROFILE)
    engine.submit(request_from_tokens("a", tokens(1, 1000), 4, BS))
    run = drain(engine)
    assert run.first_token_s["a"] == pytest.approx(PROFILE.isolated_prefill_s(1000))
    assert run.cached["a"] == 0


def test_long_prompt_is_chunked_by_budget() -> None:
    engine = Engine(PROFILE)
    engine.submit(request_from_tokens("a", tokens(1, 20000), 2, BS))
    run = drain(engine)
    prefill = [s.num_prefill_tokens for s in run.steps if s.num_prefill_tokens]
    assert prefill == [8192, 8192, 20000 - 2 * 8192]
    assert run.first_token_s["a"] == pytest.approx(PROFILE.isolated_prefill_s(20000))


def test_second_identical_request_hits_and_skips_prefill() -> None:
    engine = Engine(PROFILE)
    prompt = tokens(1, 1000)
    engine.submit(request_from_tokens("a", prompt, 4, BS))
    first = drain(engine)
    engine.submit(request_from_tokens("b", prompt, 4, BS))
    second = drain(engine, first.end_s)
    cached = (1000 - 1) // BS * BS
    assert second.cached["b"] == cached == 992
    ttft = second.first_token_s["b"] - first.end_s
    assert ttft == pytest.approx(PROFILE.isolated_prefill_s(1000 - cached, cached))
    assert ttft < 0.5 * (first.first_token_s["a"])
    stats = engine.stats()
    assert stats.prefix_cache_queries_tokens == 2000
    assert stats.prefix_cache_hits_tokens == 992


def test_hit_is_capped_below_full_prompt() -> None:
    engine = Engine(PROFILE)
    prompt = tokens(2, 64)  # exactly four blocks
    engine.submit(request_from_tokens("a", prompt, 1, BS))
    drain(engine)
    engine.submit(request_from_tokens("b", prompt, 1, BS))
    assert drain(engine).cached["b"] == 48  # at least one token must be computed


def test_output_blocks_are_cached_for_the_next_turn() -> None:
    engine = Engine(PROFILE)
    prompt, answer = tokens(3, 100), tokens(4, 40)
    engine.submit(request_from_tokens("t1", prompt, 40, BS, output_token_ids=answer))
    drain(engine)
    engine.submit(request_from_tokens("t2", prompt + answer + tokens(5, 30), 1, BS))
    assert drain(engine).cached["t2"] == 128  # blocks covering 128 of the 140 shared tokens


def test_salt_separates_caches() -> None:
    engine = Engine(PROFILE)
    prompt = tokens(1, 500)
    assert block_hashes(prompt, BS, "alice")[0] != block_hashes(prompt, BS, "bob")[0]
    assert block_hashes(prompt, BS, "alice")[1:] != block_hashes(prompt, BS, "bob")[1:]
    engine.submit(request_from_tokens("a", prompt, 1, BS, cache_salt="alice"))
    drain(engine)
    engine.submit(request_from_tokens("b", prompt, 1, BS, cache_salt="bob"))
    engine.submit(request_from_tokens("c", prompt, 1, BS))
    engine.submit(request_from_tokens("d", prompt, 1, BS, cache_salt="alice"))
    run = drain(engine)
    assert run.cached == {"b": 0, "c": 0, "d": 496}


def test_lru_evicts_least_recently_freed_tail_first() -> None:
    engine = small_engine(kv_blocks=12)
    reqs = {name: request_from_tokens(name, tokens(seed, 64), 1, BS) for seed, name in enumerate("abc")}
    for name in "abc":  # 4 blocks each, run one after another: the pool is then full of cache
        engine.submit(reqs[name])
        drain(engine)
    assert engine.stats().num_cached_blocks == 12
    engine.submit(request_from_tokens("a2", tokens(0, 64), 1, BS))  # touch a: it becomes recent
    drain(engine)
    engine.submit(request_from_tokens("d", tokens(9, 96), 1, BS))  # needs 6 blocks
    run = drain(engine)
    b, c = list(reqs["b"].block_hashes), list(reqs["c"].block_hashes)
    # b (oldest) goes first, tail block first; then c's tail; a (touched) survives.
    assert run.removed == b[::-1] + c[::-1][:2]
    for h in reqs["a"].block_hashes:
        assert engine._pool.contains(h)


def test_concurrent_prefills_share_the_token_budget() -> None:
    engine = Engine(PROFILE)
    engine.submit(request_from_tokens("a", tokens(1, 5000), 3, BS))
    engine.submit(request_from_tokens("b", tokens(2, 5000), 3, BS))
    run = drain(engine)
    assert run.steps[0].num_prefill_tokens == 8192
    assert run.steps[1].num_prefill_tokens == 10000 - 8192
    assert run.steps[1].num_decode_requests == 1  # a decodes while b finishes its prefill
    assert run.first_token_s["a"] == run.steps[0].end_s
    assert run.first_token_s["b"] == run.steps[1].end_s


def test_decode_batch_step_time_grows_with_batch_and_context() -> None:
    engine = Engine(PROFILE)
    for i in range(32):
        engine.submit(request_from_tokens(i, tokens(i, 1024), 20, BS))
    run = drain(engine)
    decode = [s for s in run.steps if s.num_decode_requests == 32 and s.num_prefill_tokens == 0]
    assert decode
    # engine-timing reference: ctx 1k, batch 32 -> about 8.4 ms per step.
    assert decode[0].duration_s == pytest.approx(0.0084, abs=0.0003)


def test_max_num_seqs_limits_admission() -> None:
    engine = small_engine(kv_blocks=1000, max_num_seqs=2)
    for i in range(3):
        engine.submit(request_from_tokens(i, tokens(i, 32), 5, BS))
    res = engine.step(0.0)
    assert res is not None and {ft.request_id for ft in res.first_tokens} == {0, 1}
    assert engine.stats().num_waiting == 1


def test_decode_out_of_blocks_preempts_last_running() -> None:
    engine = small_engine(kv_blocks=10)
    engine.submit(request_from_tokens("a", tokens(1, 60), 40, BS))  # 100 tokens = 7 blocks at the end
    engine.submit(request_from_tokens("b", tokens(2, 60), 40, BS))
    run = drain(engine)
    assert run.preempted and run.preempted[0] == "b"
    assert set(run.finish_s) == {"a", "b"}
    assert run.finish_s["a"] < run.finish_s["b"]
    assert engine.stats().num_preemptions_total == len(run.preempted)


def test_blocked_head_of_queue_waits_for_blocks() -> None:
    engine = small_engine(kv_blocks=8)
    engine.submit(request_from_tokens("a", tokens(1, 90), 10, BS))  # 7 blocks
    engine.submit(request_from_tokens("b", tokens(2, 40), 2, BS))  # 3 blocks: must wait
    first = engine.step(0.0)
    assert first is not None and [ft.request_id for ft in first.first_tokens] == ["a"]
    assert engine.stats().num_waiting == 1
    run = drain(engine, first.end_s)
    assert run.first_token_s["b"] >= run.finish_s["a"]


def test_coalesced_decode_matches_step_by_step() -> None:
    def build() -> Engine:
        engine = Engine(PROFILE)
        for i in range(8):
            engine.submit(request_from_tokens(i, tokens(i, 300 + 50 * i), 50 + 10 * i, BS))
        return engine

    fine, coarse = build(), build()
    a, b = drain(fine), drain(coarse, until_s=float("inf"))
    assert len(b.steps) < len(a.steps) / 3
    assert a.finish_s.keys() == b.finish_s.keys()
    for rid, t in a.finish_s.items():
        assert b.finish_s[rid] == pytest.approx(t, rel=1e-9)
    assert fine.stats().generation_tokens_total == coarse.stats().generation_tokens_total


def test_coalescing_stops_before_next_arrival() -> None:
    engine = Engine(PROFILE)
    engine.submit(request_from_tokens("a", tokens(1, 100), 500, BS))
    first = engine.step(0.0)
    assert first is not None
    res = engine.step(first.end_s, until_s=first.end_s + 0.05)
    assert res is not None and res.num_steps > 1
    last_start = res.end_s - res.duration_s / res.num_steps
    assert last_start < first.end_s + 0.05 <= res.end_s + 0.0001


def test_abort_releases_blocks() -> None:
    engine = small_engine(kv_blocks=20)
    engine.submit(request_from_tokens("a", tokens(1, 200), 50, BS))
    engine.submit(request_from_tokens("b", tokens(2, 200), 50, BS))
    engine.step(0.0)
    assert engine.stats().num_used_blocks > 0
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("a")
    engine.check_invariants()
    stats = engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0 and not engine.has_work()


def test_reset_prefix_cache_refused_while_in_use() -> None:
    engine = small_engine(kv_blocks=50)
    engine.submit(request_from_tokens("a", tokens(1, 200), 5, BS))
    engine.step(0.0)
    assert engine.reset_prefix_cache() is None
    drain(engine)
    dropped = engine.reset_prefix_cache()
    assert dropped is not None and len(dropped) == 12
    assert engine.stats().num_cached_blocks == 0
    engine.check_invariants()


def test_rejects_requests_that_can_never_run() -> None:
    engine = small_engine(kv_blocks=4)
    with pytest.raises(EngineRejected, match="KV capacity"):
        engine.submit(EngineRequest("x", 60, 10))
    with pytest.raises(EngineRejected, match="at least one"):
        engine.submit(EngineRequest("y", 0, 10))
    engine.submit(EngineRequest("z", 10, 10))
    with pytest.raises(EngineRejected, match="duplicate"):
        engine.submit(EngineRequest("z", 10, 10))


def test_waiting_queue_is_bounded() -> None:
    engine = Engine(PROFILE, EngineConfig(max_waiting_requests=2))
    engine.submit(EngineRequest("a", 10, 1))
    engine.submit(EngineRequest("b", 10, 1))
    with pytest.raises(EngineQueueFull):
        engine.submit(EngineRequest("c", 10, 1))
    engine.step(0.0)  # both admitted: the queue has room again
    engine.submit(EngineRequest("c", 10, 1))


def test_precomputed_hashes_without_tokens() -> None:
    engine = Engine(PROFILE)
    shared = list(range(1000, 1000 + 64))  # 64 blocks = 1024 tokens of a trace prefix
    engine.submit(EngineRequest(1, 1024 + 100, 2, [*shared, 5, 6, 7, 8, 9, 10]))
    drain(engine)
    engine.submit(EngineRequest(2, 1024 + 50, 2, [*shared, 11, 12, 13]))
    assert drain(engine).cached[2] == 1024


def test_profiles_load_and_errors_name_the_field(tmp_path: object) -> None:
    for name in ("llama3-8b-h100", "llama3-70b-h100-tp4", "llama3-8b-a100"):
        prof = load_profile(name)
        assert prof.source and prof.kv_blocks > 0
    # engine-timing reference, predicted TTFT 4k tokens: 103 / 284 / 292 ms.
    assert load_profile("llama3-8b-h100").isolated_prefill_s(4096) == pytest.approx(0.103, abs=0.002)
    assert load_profile("llama3-70b-h100-tp4").isolated_prefill_s(4096) == pytest.approx(0.284, abs=0.003)
    assert load_profile("llama3-8b-a100").isolated_prefill_s(4096) == pytest.approx(0.292, abs=0.003)
    with pytest.raises(ProfileError, match="known"):
        load_profile("nope")
    with pytest.raises(ProfileError, match="a_ms"):
        parse_profile("name: x\ndescription: y\nsource: z\na_ms: -1\n")


def test_a_block_evicted_and_stored_again_in_one_step_is_not_reported_removed() -> None:
    """A step's BlockStored events are applied before its BlockRemoved: a hash evicted and then
    cached again within the step must not be reported removed, or a consumer would drop a block
    the worker holds and file its children as orphans."""
    from loadtest.engine.block_pool import BlockPool

    pool = BlockPool(2)
    pool.allocate(2)
    assert pool.store(11) and pool.store(12)
    pool.release([11, 12], 2, 0)  # both cached and evictable; 12 is evicted first (tail first)
    pool.allocate(1)
    assert list(pool.removed) == [12]
    assert pool.store(12)  # the same content computed again in the same step
    assert list(pool.removed) == []
    pool.allocate(1)  # now 11 goes: evicted and not stored again, so it is reported
    assert list(pool.removed) == [11] and pool.contains(12) and not pool.contains(11)
