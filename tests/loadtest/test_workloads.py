from __future__ import annotations

import dataclasses
import itertools

import pytest

from loadtest.simulator.keys import KeyPath
from loadtest.workloads.ceilings import BlockChain, ceiling_infinite, ceiling_pooled_lru
from loadtest.workloads.records import BlockPrompt, ChatPrompt, WorkloadRequest, scale_arrivals
from loadtest.workloads.registry import WORKLOADS, make_workload
from loadtest.workloads.render import prompt_bytes
from loadtest.workloads.text import block_bytes, synth_text

KEYS = KeyPath()


def _chain(req: WorkloadRequest, tenant: str) -> BlockChain:
    """The ceiling chain of `req` sent by `tenant` (the production keys)."""
    return KEYS.keyed(dataclasses.replace(req, tenant=tenant)).chain()


def _block_req(
    rid: str, ids: tuple[int, ...], n_tokens: int, size: int = 4, t: float = 0.0
) -> WorkloadRequest:
    return WorkloadRequest(rid, t, "t", rid, BlockPrompt(ids, size, n_tokens), 8)


def test_synth_text_is_deterministic_ascii_of_exact_length() -> None:
    a = synth_text("k", 777)
    assert a == synth_text("k", 777) and len(a.encode()) == 777 and a.isascii()
    assert a != synth_text("k2", 777)


def test_block_prompt_text_has_exactly_n_tokens_and_partial_block_is_a_prefix() -> None:
    full = prompt_bytes(_block_req("a", (1, 2, 3), 12))
    partial = prompt_bytes(_block_req("b", (1, 2, 3), 10))
    assert len(full) == 12 and len(partial) == 10
    assert full[:10] == partial
    assert full[4:8] == block_bytes("", 2, 4)
    # An unhashed tail (kv-cache-tester) is unique to the request.
    t1 = prompt_bytes(_block_req("x", (1,), 7))
    t2 = prompt_bytes(_block_req("y", (1,), 7))
    assert t1[:4] == t2[:4] and t1[4:] != t2[4:]


def test_block_prompt_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        BlockPrompt((1, 2, 3), 4, 8)
    with pytest.raises(ValueError, match="cannot hold"):
        BlockPrompt((1,), 4, 8)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_seeded(name: str) -> None:
    a = make_workload(name, 3)
    assert a == make_workload(name, 3)
    assert a != make_workload(name, 4)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert len({r.request_id for r in a}) == len(a)


def test_agent_sessions_share_system_and_tools_and_only_append() -> None:
    reqs = make_workload("agent", 0, ["n_tenants=1", "n_sessions=4", "turns_per_session=3"])
    by_session: dict[str, list[WorkloadRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    firsts = []
    for session in by_session.values():
        prompts = [r.prompt for r in session]
        assert all(isinstance(p, ChatPrompt) for p in prompts)
        for prev, nxt in itertools.pairwise(prompts):
            assert isinstance(prev, ChatPrompt) and isinstance(nxt, ChatPrompt)
            assert nxt.messages[: len(prev.messages)] == prev.messages and nxt.tools_json == prev.tools_json
        first = prompts[0]
        assert isinstance(first, ChatPrompt)
        firsts.append((first.messages[0], first.tools_json))
        assert any(m.role == "tool" for p in prompts if isinstance(p, ChatPrompt) for m in p.messages)
    assert len(set(firsts)) == 1  # one system prompt + tool set for every session of the tenant


def test_gsp_ceiling_matches_the_closed_form() -> None:
    reqs = make_workload("gsp", 0, ["num_groups=8", "prompts_per_group=4", "system_prompt_len=512"])
    chains = [KEYS.keyed(r).chain() for r in reqs]
    # (P-1)/P of the groups' requests hit the whole 512-token system prompt (question: 128 tokens).
    expected = (3 / 4) * 512 / 640
    assert ceiling_infinite(chains).hit_ratio == pytest.approx(expected, abs=0.01)


def test_make_workload_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="known: agent"):
        make_workload("nope")
    with pytest.raises(ValueError, match="options:"):
        make_workload("rag", 0, ["bogus=1"])
    with pytest.raises(ValueError, match="n_requests"):
        make_workload("rag", 0, ["n_requests=many"])


def test_scale_arrivals_divides_times() -> None:
    reqs = [_block_req("a", (1,), 4, t=2.0), _block_req("b", (1,), 4, t=4.0)]
    assert [r.arrival_s for r in scale_arrivals(reqs, 2.0)] == [1.0, 2.0]
    with pytest.raises(ValueError):
        scale_arrivals(reqs, 0)


def test_ceilings_on_a_hand_example() -> None:
    chains = [
        _chain(_block_req("a", (1, 2, 3), 12), "ns"),
        _chain(_block_req("b", (1, 2, 9), 10), "ns"),  # hits 1,2 = 8 tokens
        _chain(_block_req("c", (2, 3), 8), "ns"),  # block 2 at the root is another chain: miss
        _chain(_block_req("d", (1, 2, 3), 11), "other"),  # another namespace: miss
    ]
    inf = ceiling_infinite(chains)
    assert (inf.hit_tokens, inf.total_tokens) == (8, 41)
    # A cache of 2 blocks keeps only the most recent chain's root side.
    lru = ceiling_pooled_lru(
        [_chain(_block_req(x, ids, 8), "ns") for x, ids in (("a", (1, 2)), ("b", (5, 6)), ("c", (1, 2)))],
        capacity_tokens=8,
    )
    assert lru.hit_tokens == 0
    lru3 = ceiling_pooled_lru(
        [_chain(_block_req(x, ids, 8), "ns") for x, ids in (("a", (1, 2)), ("b", (1, 6)), ("c", (1, 2)))],
        capacity_tokens=12,
    )
    # a: stores 1,2; b: hits 1, stores 6 → cache {2,6,1}; c hits 1 and 2.
    assert lru3.hit_tokens == 4 + 8


def test_lru_evicts_leaves_before_roots() -> None:
    chains = [BlockChain((1, 2, 3), 4, 12, 12), BlockChain((1, 7), 4, 8, 8), BlockChain((1, 2), 4, 8, 8)]
    # Capacity 3: after the first request {3,2,1} (1 most recent); the second hits 1 and adds 7,
    # evicting the leaf 3, not the root 1.
    r = ceiling_pooled_lru(chains, capacity_tokens=12)
    assert r.hit_tokens == 4 + 8


def test_working_set_counts_each_distinct_block_once_at_its_largest() -> None:
    from loadtest.workloads.ceilings import working_set_tokens

    chains = [
        _chain(_block_req("a", (1, 2), 6), "ns"),  # block 2 partial: 2 tokens
        _chain(_block_req("b", (1, 2, 3), 12), "ns"),  # block 2 full now, block 3 new
    ]
    assert working_set_tokens(chains) == 4 + 4 + 4
