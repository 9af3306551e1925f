"""Engine model for P/D disaggregation: transfer time, installing received blocks, external
tokens (a remotely prefilled request starts with prompt - 1 computed), and prefill-side holds."""

from __future__ import annotations

from importlib import resources

import pytest

from loadtest.engine import Engine, EngineRejected, EngineRequest, block_hashes, load_profile
from loadtest.engine.profile import ProfileError, parse_profile
from tests.loadtest.test_engine import BS, PROFILE, drain, small_engine, tokens


def remote(request_id: str, prompt: list[int], max_out: int = 4) -> EngineRequest:
    """A decode-side request whose whole prompt was prefilled elsewhere."""
    return EngineRequest(request_id, len(prompt), max_out, block_hashes(prompt, BS), len(prompt))


def test_transfer_time_is_setup_plus_bytes_over_bandwidth() -> None:
    p = PROFILE
    assert p.kv_transfer_s(0) == 0.0
    expect = p.kv_transfer_setup_ms / 1000 + 4096 * p.kv_bytes_per_token / p.kv_transfer_bytes_per_s
    assert p.kv_transfer_s(4096) == pytest.approx(expect)
    assert p.kv_transfer_s(4096) == pytest.approx(0.01293, rel=1e-3)  # 1 ms + 537 MB at 45 GB/s
    assert p.kv_transfer_s(8192) - p.kv_transfer_s(4096) == pytest.approx(p.kv_transfer_s(4096) - 0.001)
    with pytest.raises(ValueError):
        p.kv_transfer_s(-1)


def test_every_shipped_profile_moves_4k_tokens_faster_than_it_prefills_them() -> None:
    for name in ("llama3-8b-h100", "llama3-70b-h100-tp4", "llama3-8b-a100"):
        p = load_profile(name)
        assert 0 < p.kv_transfer_s(4096) < 0.3 * p.isolated_prefill_s(4096)


def test_profile_requires_the_transfer_fields() -> None:
    lines = resources.files("loadtest.profiles").joinpath(f"{PROFILE.name}.yaml").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.startswith("kv_transfer_bytes_per_s"))
    with pytest.raises(ProfileError, match="kv_transfer_bytes_per_s"):
        parse_profile(text)


def test_installed_blocks_are_stored_once_and_hit_by_the_remote_request() -> None:
    engine = small_engine(200)
    prompt = tokens(1, 1000)
    hashes = block_hashes(prompt, BS)
    assert engine.prefix_hit_tokens(hashes, len(prompt)) == 0
    got = engine.install_blocks("r", hashes)
    assert got.num_blocks == len(hashes) == 62 and got.removed == ()
    assert [(s.first_block_index, s.parent_block_hash) for s in got.stored] == [(0, None)]
    assert list(got.stored[0].block_hashes) == hashes
    engine.check_invariants()
    assert engine.stats().num_cached_blocks == 62
    assert engine.prefix_hit_tokens(hashes, len(prompt)) == 992
    again = engine.install_blocks("r2", hashes)
    assert again.num_blocks == 62 and again.stored == ()  # nothing new: no second BlockStored

    engine.submit(remote("r", prompt))
    run = drain(engine)
    assert run.cached["r"] == 999  # prompt - 1, as vLLM reports after a transfer
    first = run.steps[0]
    assert first.num_prefill_tokens == 1  # only the last prompt token is recomputed
    assert run.first_token_s["r"] == pytest.approx(PROFILE.step_time_s(1, 1, 0, 999.5))
    assert engine.stats().prefix_cache_hits_tokens == 999


def test_install_after_a_local_prefix_stores_only_the_missing_run() -> None:
    engine = small_engine(200)
    prompt = tokens(2, 320)
    hashes = block_hashes(prompt, BS)
    engine.install_blocks("local", hashes[:5])
    got = engine.install_blocks("r", hashes)
    assert [(s.first_block_index, s.parent_block_hash) for s in got.stored] == [(5, hashes[4])]
    assert len(got.stored[0].block_hashes) == 15


def test_external_tokens_without_the_blocks_are_recomputed() -> None:
    engine = small_engine(200)
    prompt = tokens(3, 500)
    hashes = block_hashes(prompt, BS)
    engine.install_blocks("r", hashes[:10])  # the rest never arrived (or was evicted)
    engine.submit(remote("r", prompt))
    assert drain(engine).cached["r"] == 160
    engine.submit(remote("fresh", tokens(4, 500)))
    assert drain(engine).cached["fresh"] == 0


def test_install_evicts_least_recent_blocks_but_never_its_own_chain() -> None:
    engine = small_engine(20)
    old = block_hashes(tokens(5, 16 * 12), BS)
    engine.install_blocks("old", old)
    new = block_hashes(tokens(6, 16 * 12), BS)
    got = engine.install_blocks("new", new)
    assert got.num_blocks == 12
    assert list(got.removed) == old[:4]  # 8 blank blocks, then the 4 oldest
    engine.check_invariants()
    big = block_hashes(tokens(7, 16 * 30), BS)
    partial = engine.install_blocks("big", big)
    assert partial.num_blocks == 20 and len(partial.removed) == 20  # a prefix that fits
    assert engine.prefix_hit_tokens(big, 16 * 30) == 20 * BS
    engine.check_invariants()


def test_holds_pin_blocks_against_eviction_until_released() -> None:
    engine = small_engine(10)
    prompt = tokens(8, 16 * 6)
    engine.submit(EngineRequest("p", len(prompt), 1, block_hashes(prompt, BS)))
    drain(engine)
    hashes = block_hashes(prompt, BS)
    assert engine.hold_blocks("t", hashes) == 6
    with pytest.raises(ValueError):
        engine.hold_blocks("t", hashes)
    assert engine.stats().num_used_blocks == 6  # held blocks are in use, as vLLM's delayed free
    other = block_hashes(tokens(9, 16 * 8), BS)
    assert engine.install_blocks("o", other).num_blocks == 4  # only the 4 free blocks
    assert engine.prefix_hit_tokens(hashes, len(prompt)) == 5 * BS  # the held prompt survived
    assert engine.reset_prefix_cache() is None  # refused while blocks are held
    assert engine.release_hold("t") and not engine.release_hold("t")
    assert engine.stats().num_used_blocks == 0
    engine.check_invariants()


def test_a_preempted_remote_request_recomputes_and_finishes() -> None:
    engine = small_engine(9, max_num_seqs=2)
    prompt = tokens(10, 16 * 4 + 8)  # 4 full blocks and a received tail of 8 tokens
    engine.install_blocks("r", block_hashes(prompt, BS))
    engine.submit(EngineRequest("big", 16 * 4, 40, block_hashes(tokens(11, 64), BS)))
    engine.submit(remote("r", prompt, max_out=40))
    run = drain(engine)
    assert run.preempted == ["r"]  # the last admitted running request
    assert run.cached["r"] == len(prompt) - 1  # fixed at the first scheduling
    at = run.steps.index(next(s for s in run.steps if s.preempted))
    readmitted = next(s for s in run.steps[at + 1 :] if s.num_prefill_tokens)
    assert readmitted.num_prefill_tokens > 8  # what was not in cached blocks is computed again
    assert set(run.finish_s) == {"r", "big"}
    engine.check_invariants()


def test_negative_external_tokens_are_rejected() -> None:
    engine = Engine(PROFILE)
    with pytest.raises(EngineRejected):
        engine.submit(EngineRequest("x", 10, 1, (), -1))
