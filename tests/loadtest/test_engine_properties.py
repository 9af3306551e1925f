"""Property tests: random submits, steps and aborts keep the engine's block accounting exact,
every request ends, and coalesced decode equals step-by-step replay."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from loadtest.engine import Engine, EngineConfig, EngineRejected, EngineRequest, load_profile

PROFILE = load_profile("llama3-8b-h100")

request_st = st.tuples(
    st.integers(0, 3),  # shared prefix group
    st.integers(1, 300),  # prompt tokens
    st.integers(1, 40),  # output tokens
    st.booleans(),  # abort it later
)


def build(spec: tuple[int, int, int, bool], i: int, block_size: int) -> EngineRequest:
    group, n_prompt, n_out, _ = spec
    n_blocks = (n_prompt + n_out) // block_size
    hashes = [
        hash((group, j)) & (2**64 - 1) if j < 6 else hash((i, j)) & (2**64 - 1) for j in range(n_blocks)
    ]
    return EngineRequest(i, n_prompt, n_out, hashes)


@settings(max_examples=60, deadline=None)
@given(st.lists(request_st, min_size=1, max_size=25), st.integers(30, 80), st.integers(16, 256))
def test_random_workloads_keep_invariants(
    specs: list[tuple[int, int, int, bool]], kv_blocks: int, budget: int
) -> None:
    engine = Engine(
        PROFILE, EngineConfig(kv_blocks=kv_blocks, block_size_tokens=8, max_num_batched_tokens=budget)
    )
    finished: set[int] = set()
    aborted: set[int] = set()
    now = 0.0
    for i, spec in enumerate(specs):
        try:
            engine.submit(build(spec, i, 8))
        except EngineRejected:
            assert -(-(spec[1] + spec[2]) // 8) > kv_blocks  # only what can never fit
            aborted.add(i)
            continue
        res = engine.step(now)
        engine.check_invariants()
        if res is not None:
            now = res.end_s
            finished.update(int(str(f.request_id)) for f in res.finished)
        if spec[3] and i not in finished and engine.abort(i):
            aborted.add(i)
            engine.check_invariants()
    for _ in range(20_000):
        res = engine.step(now)
        if res is None:
            break
        engine.check_invariants()
        now = res.end_s
        for f in res.finished:
            finished.add(int(str(f.request_id)))
            assert f.num_output_tokens == specs[int(str(f.request_id))][2]
    assert not engine.has_work()
    assert finished | aborted == set(range(len(specs))) and not finished & aborted
    stats = engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0


# Cached blocks freed and evicted in another order by a run that allocated all its blocks at once:
# a later prefix hit, and so a later step, differed by 0.46 µs.
_EVICTION_ORDER = [
    (0.0, (0, 1, 1, False)), (0.0, (0, 93, 29, False)), (0.0, (0, 109, 29, False)),
    (0.0, (0, 254, 11, False)), (0.0, (2, 88, 1, False)), (0.125, (0, 104, 1, False)),
    (0.125, (0, 190, 11, False)), (0.140625, (1, 257, 9, False)), (0.1953125, (2, 49, 1, False)),
    (0.109375, (3, 229, 13, False)), (0.0859375, (0, 97, 17, False)), (0.046875, (0, 76, 22, False)),
    (0.0546875, (0, 285, 21, False)),
]  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.2), request_st), min_size=1, max_size=15))
@example(_EVICTION_ORDER)
def test_coalesced_decode_equals_step_by_step(
    arrivals: list[tuple[float, tuple[int, int, int, bool]]],
) -> None:
    arrivals = sorted(arrivals, key=lambda a: a[0])

    def replay(coalesce: bool) -> dict[int, float]:
        engine = Engine(PROFILE, EngineConfig(kv_blocks=200, block_size_tokens=8))
        done: dict[int, float] = {}
        now, k = 0.0, 0
        while k < len(arrivals) or engine.has_work():
            if not engine.has_work():
                now = max(now, arrivals[k][0])
            while k < len(arrivals) and arrivals[k][0] <= now:
                engine.submit(build(arrivals[k][1], k, 8))
                k += 1
            until = (arrivals[k][0] if k < len(arrivals) else float("inf")) if coalesce else None
            res = engine.step(now, until)
            assert res is not None
            now = res.end_s
            for f in res.finished:
                done[int(str(f.request_id))] = res.end_s
        return done

    fine, coarse = replay(False), replay(True)
    assert fine.keys() == coarse.keys()
    for rid, t in fine.items():
        assert abs(coarse[rid] - t) < 1e-9
