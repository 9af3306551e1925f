from __future__ import annotations

import gzip
import json
import lzma
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loadtest.simulator.keys import KeyPath
from loadtest.traces.load import load_trace
from loadtest.traces.mooncake import TraceFormatError, read_mooncake
from loadtest.traces.users import replay_as_users
from loadtest.workloads.ceilings import ceiling_infinite
from loadtest.workloads.records import BlockPrompt, scale_arrivals
from loadtest.workloads.render import prompt_bytes
from policies.base import Isolation
from prompt_normalizer.types import PUBLIC_NAMESPACE


def _write_mooncake(path: Path) -> None:
    rows = [
        {"timestamp": 1500, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 1300, "output_length": 0, "hash_ids": [0, 1, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _write_kvct(path: Path) -> None:
    doc = {
        "id": "s1",
        "block_size": 64,
        "hash_id_scope": "local",
        "tool_tokens": 100,
        "system_tokens": 30,
        "requests": [
            {"t": 0.0, "type": "n", "in": 200, "out": 5, "hash_ids": [1, 2, 3]},
            {
                "t": 10.0,
                "type": "subagent",
                "agent_id": "a1",
                "requests": [
                    {"t": 2.5, "type": "n", "in": 128, "out": 7, "hash_ids": [1, 2]},
                ],
            },
            {"t": 11.0, "type": "n", "in": 260, "out": 5, "hash_ids": [1, 2, 3, 4]},
        ],
    }
    path.write_text(json.dumps(doc))


def test_mooncake_reader_orders_and_converts(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    _write_mooncake(f)
    reqs = read_mooncake(f)
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]
    first = reqs[0]
    assert isinstance(first.prompt, BlockPrompt) and first.prompt.block_size_tokens == 512
    assert first.max_output_tokens == 1  # output 0 becomes one token
    assert len(prompt_bytes(first)) == 1300
    # The second request's prompt is a prefix of the first's text: the shared hash ids.
    assert prompt_bytes(reqs[1]) == prompt_bytes(first)[:1000]
    assert load_trace(f).trace_format == "mooncake"


def test_mooncake_reader_names_the_bad_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n'
    )
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:2"):
        read_mooncake(f)
    f.write_text('{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(TraceFormatError, match="cannot hold"):
        read_mooncake(f)
    with pytest.raises(TraceFormatError, match="no such trace"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("write", [_write_mooncake, _write_kvct])
def test_gzip_and_xz_files_read_like_the_plain_file_whatever_their_suffix(
    tmp_path: Path, write: Callable[[Path], None]
) -> None:
    plain = tmp_path / "plain"
    write(plain)
    expected = load_trace(plain)
    raw = plain.read_bytes()
    for name, packed in [
        ("t.gz", gzip.compress(raw)),
        ("t.xz", lzma.compress(raw)),
        ("t.json", lzma.compress(raw)),  # recognised by its magic bytes, not its suffix
    ]:
        f = tmp_path / name
        f.write_bytes(packed)
        got = load_trace(f)
        assert (got.trace_format, got.requests) == (expected.trace_format, expected.requests)


def test_a_damaged_compressed_file_is_a_trace_error(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    _write_mooncake(f)
    raw = f.read_bytes()
    cut_xz = tmp_path / "cut.jsonl.xz"
    cut_xz.write_bytes(lzma.compress(raw)[:-20])
    cut_gz = tmp_path / "cut.jsonl.gz"
    cut_gz.write_bytes(gzip.compress(raw)[:-12])
    bad_gz = tmp_path / "bad.jsonl.gz"
    packed = bytearray(gzip.compress(raw))
    packed[12:20] = b"\xff" * 8  # corrupt the deflate stream after the header
    bad_gz.write_bytes(bytes(packed))
    for bad in (cut_xz, cut_gz, bad_gz):
        with pytest.raises(TraceFormatError, match=rf"{bad.name}: cannot read"):
            load_trace(bad)


def test_kvcache_tester_reader_includes_subagents(tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    _write_kvct(f)
    t = load_trace(f)
    assert t.trace_format == "kv-cache-tester" and t.block_size_tokens == 64
    assert [r.arrival_s for r in t.requests] == [0.0, 11.0, 12.5]
    sub = t.requests[2]
    assert sub.session == "s1/a1" and sub.max_output_tokens == 7
    # 200 tokens over 3 hashed blocks: an 8-token unhashed tail.
    assert len(prompt_bytes(t.requests[0])) == 200
    chains = [KeyPath().keyed(r).chain() for r in t.requests]
    # Request 2 hits blocks 1,2,3 (192 tokens); the sub-agent (same id space) hits 1,2 (128).
    assert ceiling_infinite(chains).hit_tokens == 192 + 128


def test_kvcache_tester_sub_agents_start_when_the_turn_that_spawned_them_ended(tmp_path: Path) -> None:
    # Turn 0 is answered at 3 s and spawns two sub-agents that end at 20 s and 25 s (`t` is a
    # sub-agent's end); the main agent's next turn comes at 30 s.
    def sub(t: float, duration_s: float, name: str) -> dict[str, Any]:
        rows = [
            {"t": 1.0, "in": 128, "out": 7, "hash_ids": [1, 2], "api_time": 2.0},
            {"t": 5.0, "in": 192, "out": 7, "hash_ids": [1, 2, 3], "api_time": 1.0},
        ]
        ms = 1000 * duration_s
        return {"t": t, "type": "subagent", "agent_id": name, "duration_ms": ms, "requests": rows}

    doc = {
        "id": "s1",
        "block_size": 64,
        "requests": [
            {"t": 0.0, "in": 200, "out": 5, "hash_ids": [1, 2, 3], "api_time": 3.0},
            sub(20.0, 17.0, "a"),
            sub(25.0, 22.0, "b"),
            {"t": 30.0, "in": 260, "out": 5, "hash_ids": [1, 2, 3, 4], "api_time": 4.0},
            {"t": 40.0, "in": 300, "out": 5, "hash_ids": [1, 2, 3, 4], "api_time": 1.0},
        ],
    }
    f = tmp_path / "s.json"
    f.write_text(json.dumps(doc))
    by_id = {r.request_id: r for r in load_trace(f).requests}
    # When the recording sent each: the sub-agents' requests from their start, 3 s.
    assert {k: r.arrival_s for k, r in by_id.items()} == {
        "s1#0": 0.0, "s1/a#0": 4.0, "s1/a#1": 8.0, "s1/b#0": 4.0, "s1/b#1": 8.0, "s1#3": 30.0, "s1#4": 40.0,
    }  # fmt: skip
    # What each waits for in a closed loop, and how long after the last of them it came.
    assert {k: (r.follows, r.think_s) for k, r in by_id.items()} == {
        "s1#0": ((), 0.0),
        "s1/a#0": (("s1#0",), 1.0),
        "s1/a#1": (("s1/a#0",), 2.0),
        "s1/b#0": (("s1#0",), 1.0),
        "s1/b#1": (("s1/b#0",), 2.0),
        "s1#3": (("s1#0", "s1/a#1", "s1/b#1"), 21.0),
        "s1#4": (("s1#3",), 6.0),
    }
    users = replay_as_users(list(by_id.values()), 2)
    assert {r.follows for r in users if r.request_id.endswith("s1#4")} == {("u0/s1#3",), ("u1/s1#3",)}
    scaled = {r.request_id: r for r in scale_arrivals(users, 2.0)}
    assert (scaled["u1/s1#3"].arrival_s, scaled["u1/s1#3"].think_s) == (15.0, 10.5)


def test_replay_as_users_shares_only_the_prefix(tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    _write_kvct(f)
    t = load_trace(f, users=3, user_spread_s=100.0, seed=1)
    assert len(t.requests) == 9
    assert t.requests == load_trace(f, users=3, user_spread_s=100.0, seed=1).requests
    by_user: dict[str, list[bytes]] = {}
    for r in t.requests:
        by_user.setdefault(r.request_id.split("/")[0], []).append(prompt_bytes(r))
    firsts = [v[0] for v in by_user.values()]
    # system 30 + tools 100 tokens = 2 whole 64-token blocks shared, the rest salted per user.
    assert len({p[:128] for p in firsts}) == 1
    assert len({p[128:192] for p in firsts}) == 3
    with pytest.raises(ValueError):
        replay_as_users(list(t.requests), 0)


@pytest.mark.parametrize(
    ("name", "ceiling"),
    [("mooncake-conversation", 0.374), ("mooncake-synthetic", 0.651), ("kvct-agent", 0.959)],
)
def test_infinite_ceilings_match_the_published_table(name: str, ceiling: float) -> None:
    # The shipped traces, by name: the ceilings of their upstream README (token-weighted, infinite cache).
    t = load_trace(name)
    keys = KeyPath()
    assert ceiling_infinite(keys.keyed(r).chain() for r in t.requests).hit_ratio == pytest.approx(
        ceiling, abs=0.0006
    )


def test_session_users_as_tenants_share_only_the_public_system_and_tools_chain(tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    _write_kvct(f)
    t = load_trace(f, users=3, tenant_per_user=True, seed=1)
    assert {r.tenant for r in t.requests} == {"trace-u0", "trace-u1", "trace-u2"}
    keys = KeyPath(isolation=Isolation.SHARED_PUBLIC)
    firsts = {}
    for r in t.requests:
        firsts.setdefault(r.tenant, keys.keyed(r))
    assert all(k.immutable_blocks == 2 for k in firsts.values())  # (30 + 100) // 64
    assert len({k.public_block_keys for k in firsts.values()}) == 1
    assert len({k.block_keys[0] for k in firsts.values()}) == 3  # own namespaces stay apart
    assert keys.tenant("trace-u0").namespace != PUBLIC_NAMESPACE
    strict = KeyPath().keyed(t.requests[0])
    assert strict.public_block_keys == () and strict.immutable_blocks == 2
