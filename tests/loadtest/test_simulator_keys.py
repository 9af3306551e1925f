"""The simulator builds RouteRequests, salts and KV events with the identity rules of `policies`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.cli import main
from loadtest.engine import Engine, EngineConfig, EngineRequest, load_profile
from loadtest.engine.hashing import block_hashes
from loadtest.simulator.keys import SIM_SECRET, KeyPath
from loadtest.simulator.loop import EngineHooks, LoopConfig, run_loop
from loadtest.workloads.records import BlockPrompt, ChatMessage, ChatPrompt, TextPrompt, WorkloadRequest
from loadtest.workloads.registry import make_workload
from policies.base import Isolation, KvEvent, KvEventKind, RouteDecision, WorkerId
from policies.identity import TenantDirectory
from policies.registry import make_policy
from prompt_normalizer.types import PUBLIC_NAMESPACE, BlockKey

SYSTEM = "You are the shared agent. " * 20
TOOLS = ('{"function":{"name":"search","parameters":{}},"type":"function"}',)


def _chat(rid: str, tenant: str, user: str) -> WorkloadRequest:
    prompt = ChatPrompt((ChatMessage("system", SYSTEM), ChatMessage("user", user)), TOOLS)
    return WorkloadRequest(rid, 0.0, tenant, rid, prompt, 4)


def test_tenant_namespaces_never_meet_the_public_one_and_roots_are_keyed() -> None:
    keys = KeyPath()
    assert keys.tenant("public").namespace != PUBLIC_NAMESPACE
    trace = WorkloadRequest("r", 0.0, "public", "", BlockPrompt((1, 2, 3), 512, 1500), 1)
    a = keys.keyed(trace)
    assert len(a.chain_keys) == 3 and a.block_keys == a.chain_keys[:2]  # the partial block: no route key
    assert keys.route_request(trace, a).namespace == "tenant:public"
    # Isolation is not part of the identity: a `public` tenant keys in its own namespace too.
    public = KeyPath(tenant_isolation={"public": Isolation.PUBLIC})
    assert public.keyed(trace).chain_keys == a.chain_keys
    assert public.route_request(trace, public.keyed(trace)).namespace == "tenant:public"
    assert set(a.chain_keys).isdisjoint(keys.keyed(dataclasses.replace(trace, tenant="other")).chain_keys)
    assert set(a.chain_keys).isdisjoint(KeyPath(secret=b"another deployment").keyed(trace).chain_keys)
    assert keys.keyed(trace).chain_keys == a.chain_keys


@pytest.mark.parametrize("block_size", [16, 64])
def test_tenants_identities_and_route_namespaces_at_every_isolation_level(block_size: int) -> None:
    keys = KeyPath(tenant_isolation={i.value: i for i in Isolation})
    for isolation in Isolation:
        tenant = keys.tenant(isolation.value)
        # The deployment's tenant: namespace, isolation and the salt under the simulator's secret.
        assert tenant == TenantDirectory(SIM_SECRET).add(isolation.value, isolation)
        own, public = keys.identities(tenant, block_size)
        assert own == dataclasses.replace(keys.base, block_size_tokens=block_size, namespace=tenant.namespace)
        assert (public is None) == (isolation is Isolation.STRICT)
        assert public is None or public == dataclasses.replace(own, namespace=PUBLIC_NAMESPACE)
        req = _chat("r", isolation.value, "a question")
        kp = keys.keyed(req)
        route = keys.route_request(req, kp)
        assert route.namespace == own.namespace and route.isolation is isolation  # what admission sets
        assert bool(kp.public_block_keys) == (public is not None)
        assert keys.namespace_of_salt(tenant.cache_salt) == tenant.namespace
    assert keys.namespace_of_salt(keys.public_salt) == PUBLIC_NAMESPACE
    session = dataclasses.replace(_chat("s", "strict", "q"), session="conv")
    assert keys.route_request(session, keys.keyed(session)).session_key == "tenant:strict/conv"


def test_chat_keys_are_the_normalizers_token_keys_of_what_the_engine_caches() -> None:
    keys = KeyPath()
    req = _chat("a", "acme", "hello there " * 10)
    kp = keys.keyed(req)
    assert kp.tokens is not None and kp.n_tokens == len(kp.tokens)
    own, _ = keys.identities(keys.tenant("acme"), 16)
    expected = keys.normalizer.keys_for_tokens(np.frombuffer(kp.tokens, dtype=np.uint8), own)
    assert kp.block_keys == expected and len(expected) == kp.n_tokens // 16
    assert kp.immutable_blocks >= len(SYSTEM) // 16 - 1  # system prompt + tools are immutable


def test_isolation_levels_share_only_public_blocks_and_salts_follow_the_wholly_public_rule() -> None:
    keys = KeyPath(isolation=Isolation.SHARED_PUBLIC, tenant_isolation={"c": Isolation.STRICT})
    a, b, c = (keys.keyed(_chat(t, t, f"question of {t} " * 8)) for t in ("a", "b", "c"))
    n = a.immutable_blocks
    assert n > 0 and a.public_block_keys[:n] == b.public_block_keys[:n]  # one promoted chain
    assert a.block_keys[0] != b.block_keys[0]  # own namespaces stay apart
    assert c.public_block_keys == ()  # strict tenants get no public identity
    routes = {t: keys.route_request(_chat(t, t, "x"), kp) for t, kp in zip("abc", (a, b, c), strict=True)}
    route = routes["a"]
    assert route.isolation is Isolation.SHARED_PUBLIC and route.immutable_blocks == n
    plain = RouteDecision(WorkerId("w0"), 0.0, "r")
    promoted = dataclasses.replace(plain, shared_prefix_blocks=n)
    assert keys.cache_salt(route, plain) == keys.tenant("a").cache_salt
    # The private tail is not public: the tenant's salt even when the prefix was routed as public.
    assert keys.cache_salt(route, promoted) == keys.tenant("a").cache_salt
    whole = dataclasses.replace(route, n_prompt_tokens=n * a.block_size_tokens)
    assert keys.cache_salt(whole, promoted) == keys.public_salt
    strict_whole = dataclasses.replace(routes["c"], n_prompt_tokens=n * c.block_size_tokens)
    assert keys.cache_salt(strict_whole, promoted) == keys.tenant("c").cache_salt
    public = KeyPath(isolation=Isolation.PUBLIC)
    p = public.keyed(_chat("p", "p", "x"))
    assert p.public_block_keys[:n] == a.public_block_keys[:n]  # the same public twin as shared_public
    p_route = public.route_request(_chat("p", "p", "x"), p)
    assert public.cache_salt(p_route, plain) == public.tenant("p").cache_salt  # nothing routed as public
    assert len({keys.tenant(t).cache_salt for t in "abc"} | {keys.public_salt}) == 4


def _shared_agent_run(
    tmp_path: Path, isolation: str, *extra: str, sessions: int = 12, turns: int = 2
) -> dict[str, Any]:
    out = tmp_path / f"{isolation}.json"
    args = ["simulate", "--workload", "agent", "--policy", "cost", "--isolation", isolation, "--workers", "2"]
    args += ["--workload-arg", "shared_prefix=true", "--workload-arg", "n_tenants=4"]
    args += ["--workload-arg", f"n_sessions={sessions}", "--workload-arg", f"turns_per_session={turns}"]
    assert main([*args, *extra, "--quiet", "--json", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_promotion_of_a_shared_system_and_tools_prefix_is_exercised(tmp_path: Path) -> None:
    shared = _shared_agent_run(tmp_path, "shared_public")
    strict = _shared_agent_run(tmp_path, "strict")
    assert shared["config"]["isolation"] == "shared_public"
    assert shared["summary"]["policy_counters"]["public_promotions"] >= 1
    assert strict["summary"]["policy_counters"]["public_promotions"] == 0
    # Public tenants share keys but, salted per tenant, never KV across tenants: the same ceiling.
    public = _shared_agent_run(tmp_path, "public")
    assert public["summary"]["ceiling_infinite"] == pytest.approx(strict["summary"]["ceiling_infinite"])


class _Recorder:
    """Round robin that keeps every RouteRequest and KV event it is given."""

    name = "recorder"

    def __init__(self) -> None:
        self.inner = make_policy("round_robin", seed=0)
        self.routes: dict[str, Any] = {}
        self.events: list[KvEvent] = []

    def select(self, req: Any, workers: Any, now_s: float) -> RouteDecision | None:
        self.routes[req.request_id] = req
        return self.inner.select(req, workers, now_s)

    def on_dispatch(self, req: Any, decision: Any, now_s: float) -> None:
        return None

    def on_complete(self, obs: Any, now_s: float) -> None:
        return None

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        self.events.append(event)


@pytest.mark.parametrize("isolation", list(Isolation))
def test_kv_events_carry_token_ids_that_key_to_the_request_keys(isolation: Isolation) -> None:
    keys = KeyPath(isolation=isolation)
    reqs = [
        _chat("a", "acme", "first question " * 6),
        WorkloadRequest("t", 0.1, "zeta", "", TextPrompt("x" * 70), 2),
    ]
    profile = load_profile("llama3-8b-h100")
    engines = [Engine(profile, EngineConfig(kv_blocks=512, seed=0))]

    def hash_tokens(tokens: Any, size: int, salt: str | None) -> list[int]:
        return block_hashes(tokens, size, salt, 0)

    hooks = EngineHooks(lambda *a: EngineRequest(a[0], a[1], a[2], a[3]), hash_tokens, keys)
    spy = _Recorder()
    run_loop(reqs, engines, spy, hooks, LoopConfig(kv_events=True))  # type: ignore[arg-type]
    hasher = keys.normalizer.token_hasher(keys.base)
    roots = [e for e in spy.events if e.kind is KvEventKind.BLOCK_STORED and e.parent_block_hash is None]
    assert {e.namespace for e in roots} == {"tenant:acme", "tenant:zeta"}
    by_namespace = {spy.routes[r].namespace: spy.routes[r] for r in spy.routes}
    for event in roots:
        route = by_namespace[event.namespace]
        prev = hasher.root(event.namespace or "", None)
        got: list[BlockKey] = []
        for i in range(len(event.block_hashes)):
            prev = hasher.chain(prev, event.token_ids[i * 16 : (i + 1) * 16])
            got.append(prev)
        assert len(got) >= 4 and tuple(got) == route.block_keys[: len(got)]


@pytest.mark.parametrize("workload", ["zipf", "agent"])
def test_shared_prefix_options_share_the_system_prompt_across_tenants(workload: str) -> None:
    extra = ["shared_system_chars=800"] if workload == "zipf" else ["shared_prefix=true"]
    reqs = make_workload(workload, 0, [*extra, "n_tenants=3"])
    firsts = {r.tenant: r.prompt for r in reqs}
    assert len(firsts) == 3
    systems = {p.messages[0].content for p in firsts.values() if isinstance(p, ChatPrompt)}
    assert len(systems) == 1


@pytest.mark.slow
def test_precise_mode_files_a_public_tenants_events_under_its_request_keys(tmp_path: Path) -> None:
    """`public` tenants' KV events must land where their request keys look (their own namespace):
    precise mode then routes them as it routes strict tenants (no prompt here is wholly public).
    The caches are small enough that evictions matter: with events filed elsewhere, the index
    keeps stale holdings and the hit ratio moves by several points."""
    extra = ("--kv-events", "--kv-blocks-per-worker", "1000")
    runs = {i: _shared_agent_run(tmp_path, i, *extra, sessions=16, turns=4) for i in ("strict", "public")}
    for doc in runs.values():
        counters = doc["summary"]["policy_counters"]
        assert doc["config"]["precise"] and counters["kv_events_applied"] > 0
        assert counters["kv_event_orphans:default"] == counters["kv_event_mismatched:default"] == 0
    strict, public = (runs[i]["summary"] for i in ("strict", "public"))
    assert public["hit_ratio"] == pytest.approx(strict["hit_ratio"], abs=0.005)
    assert public["policy_counters"]["kv_events_applied"] == strict["policy_counters"]["kv_events_applied"]
