"""The drifting agent workload and the drift benchmark's replay (small sizes; no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from loadtest.bench_drift import PrefixCache, replay, rules_off, rules_on
from loadtest.drift_workload import CLOCK_PREFIX, DriftWorkloadConfig, generate
from prompt_normalizer.types import BlockKey

SMALL = DriftWorkloadConfig(seed=3, apps=2, sessions=4, turns=3, system_words=300, tools_per_app=4)


def test_workload_is_seeded_and_variants_share_conversations() -> None:
    a, b = generate(SMALL, "drifting"), generate(SMALL, "drifting")
    assert [r.body for r in a] == [r.body for r in b]
    clean = generate(SMALL, "drift_free")
    assert len(a) == len(clean) == SMALL.sessions * SMALL.turns * 2
    for d, c in zip(a, clean, strict=True):
        assert (d.session, d.turn, d.step) == (c.session, c.turn, c.step)
        assert [m["role"] for m in d.body["messages"]] == [m["role"] for m in c.body["messages"]]
    assert generate(DriftWorkloadConfig(seed=4, apps=2, sessions=4, turns=3), "drifting")[0].body != a[0].body


def test_drifting_variant_really_drifts() -> None:
    requests = generate(SMALL, "drifting")
    session = [r for r in requests if r.session == "agent-0"]
    clocks = {r.body["messages"][0]["content"].split(CLOCK_PREFIX)[1].split("\n")[0] for r in session}
    assert len(clocks) == len(session)  # a new time on every request
    orders = {tuple(r.body["tools"][0]["function"]["parameters"]) for r in session}
    assert len(orders) > 1  # schema keys reordered between requests
    with_reasoning = [sum("reasoning_content" in m for m in r.body["messages"]) for r in session]
    assert max(with_reasoning) == SMALL.keep_reasoning  # only the latest assistant turn keeps it
    clean = [r for r in generate(SMALL, "drift_free") if r.session == "agent-0"]
    assert all(CLOCK_PREFIX not in r.body["messages"][0]["content"] for r in clean)
    assert not any("reasoning_content" in m for r in clean for m in r.body["messages"])


def test_rules_on_recover_most_of_the_ceiling() -> None:
    drifting, clean = generate(SMALL, "drifting"), generate(SMALL, "drift_free")
    base: dict[str, object] = {"mode": "approximate"}
    ceiling = replay("ceiling", clean, rules_off(base), 16, 0)
    off = replay("off", drifting, rules_off(base), 16, 0)
    on = replay("on", drifting, rules_on(base), 16, 0)
    assert ceiling.hit_ratio > 0.5
    assert off.hit_ratio < 0.2 * ceiling.hit_ratio
    assert on.hit_ratio >= 0.9 * ceiling.hit_ratio
    assert on.drift_events == 0 and off.drift_events > 0
    assert set(off.drift_fields) == {"messages[*].content"}  # the clock in the system prompt
    no_json = replay("no json", drifting, rules_on(base, "canonical_json"), 16, 0)
    assert set(no_json.drift_fields) == {"tools[*]"}


def test_prefix_cache_walks_from_block_zero_and_evicts_lru() -> None:
    cache = PrefixCache(capacity_blocks=3)
    k = [BlockKey(i) for i in range(10)]
    assert cache.lookup_insert(k[:3]) == 0
    assert cache.lookup_insert(k[:2]) == 2
    assert cache.lookup_insert([k[5], k[0]]) == 0  # never skips a missing first block
    assert cache.lookup_insert(k[:3]) == 2  # k2 was least recently used and evicted: the walk stops there


def test_command_prints_a_report() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "drift", "--sessions", "3", "--turns", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["config"]["workload"]["sessions"] == 3 and report["git_sha"]
    names = [r["name"] for r in report["results"]]
    assert names[:3] == ["drift-free ceiling", "drifting, rules off", "drifting, rules on"]
    assert report["results"][0]["of_ceiling"] == 1.0
