from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Isolation, Observation, RouteRequest, WorkerId, WorkerView
from policies.cost_policy import CostPolicy
from policies.prefix_policy import SharedSettings
from policies.tenants import PromotionConfig, TenantSettings
from tests.policies.factories import req, workers

SP = Isolation.SHARED_PUBLIC


def _run(p: CostPolicy, r: RouteRequest, views: list[WorkerView], now: float) -> WorkerId:
    d = p.select(r, views, now)
    assert d is not None
    p.on_dispatch(r, d, now)
    p.on_complete(Observation(r, d.worker, prompt_tokens=r.n_prompt_tokens), now)
    return d.worker


def _policy(**promotion: object) -> CostPolicy:
    return CostPolicy(seed=3, shared=SharedSettings(promotion=PromotionConfig(**promotion)))  # type: ignore[arg-type]


def test_a_tenant_never_matches_another_tenants_private_chain() -> None:
    p = _policy()
    _run(p, req("a", range(100), tenant="alice"), [WorkerView(WorkerId("w0"))], 0.0)
    for iso in Isolation:
        d = p.select(req("b", range(100), tenant="bob", isolation=iso, immutable=100), workers(0, 0), 1.0)
        assert d is not None and d.matched_tokens == 0
    d = p.select(req("a2", range(101), tenant="alice"), workers(0, 0), 1.0)
    assert d is not None and d.matched_tokens > 0


def test_promotion_needs_k_distinct_opted_in_tenants_within_the_window() -> None:
    p = _policy(min_tenants=3, window_s=100.0)
    w0 = [WorkerView(WorkerId("w0"))]
    # Strict tenants and repeats by one tenant do not count.
    for i, (tenant, iso) in enumerate(
        [("s1", Isolation.STRICT), ("s2", Isolation.STRICT), ("a", SP), ("a", SP)]
    ):
        _run(p, req(f"r{i}", range(40), tenant=tenant, isolation=iso, immutable=32), w0, float(i))
    assert p.stats().counters["public_promotions"] == 0
    _run(p, req("r4", range(40), tenant="b", isolation=SP, immutable=32), w0, 5.0)
    assert p.stats().counters["public_promotions"] == 0
    # The third distinct opted-in tenant promotes the immutable chain; its request lies wholly
    # inside it, so it is the first routed under the public namespace (nobody holds it there yet).
    r5 = req("r5", range(32), tenant="c", isolation=SP, immutable=32, extra_tokens=0)
    d5 = p.select(r5, workers(0, 0, 0), 6.0)
    assert d5 is not None and d5.shared_prefix_blocks == 32 and d5.reason == "miss"
    assert p.stats().counters["public_promotions"] == 1
    p.on_dispatch(r5, d5, 6.0)
    # A newcomer wholly inside the public chain matches it there (less vLLM's last token)...
    d = p.select(
        req("r6", range(32), tenant="d", isolation=SP, immutable=32, extra_tokens=0), workers(0, 0, 0), 7.0
    )
    assert d is not None and d.worker == d5.worker and d.matched_tokens == 31 * 16
    assert d.shared_prefix_blocks == 32
    # ...one running past it keeps its own salt: nothing it could reuse, and no public routing...
    d = p.select(req("r6b", range(40), tenant="d", isolation=SP, immutable=32), workers(0, 0, 0), 7.0)
    assert d is not None and d.matched_tokens == 0 and d.shared_prefix_blocks == 0
    # ...and a strict tenant never matches it.
    d = p.select(
        req("r7", range(32), tenant="e", isolation=Isolation.STRICT, immutable=32, extra_tokens=0),
        workers(0, 0, 0),
        7.0,
    )
    assert d is not None and d.matched_tokens == 0 and d.shared_prefix_blocks == 0
    lines = p.drain_promotion_events()
    assert len(lines) == 1 and lines[0].startswith("promote chain=") and "reason=tenants" in lines[0]
    p.check_invariants()


def test_tenants_outside_the_window_do_not_promote() -> None:
    p = _policy(min_tenants=2, window_s=10.0)
    w0 = [WorkerView(WorkerId("w0"))]
    _run(p, req("r0", range(8), tenant="a", isolation=SP, immutable=8), w0, 0.0)
    _run(p, req("r1", range(8), tenant="b", isolation=SP, immutable=8), w0, 50.0)
    assert p.stats().counters["public_promotions"] == 0
    _run(p, req("r2", range(8), tenant="c", isolation=SP, immutable=8), w0, 55.0)
    assert p.stats().counters["public_promotions"] == 1


def test_cold_public_chain_is_demoted_and_allow_list_promotes_at_once() -> None:
    from tests.policies.factories import chain

    allowed = chain("public", range(500, 508))[-1]
    p = _policy(min_tenants=2, window_s=100.0, cool_after_s=50.0, allow_list=frozenset({allowed}))
    w0 = [WorkerView(WorkerId("w0"))]
    _run(p, req("r0", range(8), tenant="a", isolation=SP, immutable=8), w0, 0.0)
    _run(p, req("r1", range(8), tenant="b", isolation=SP, immutable=8), w0, 1.0)
    assert p.stats().counters["public_promotions"] == 1
    d = p.select(req("x", range(500, 508), tenant="z", isolation=SP, immutable=8, extra_tokens=0), w0, 2.0)
    assert d is not None and d.shared_prefix_blocks == 8
    p.select(req("late", range(900, 901), tenant="q", isolation=SP), w0, 200.0)
    stats = p.stats().counters
    assert stats["public_demotions"] == 1 and stats["public_promotions"] == 2
    # After demotion the chain is private again until K tenants present it anew.
    d = p.select(req("r2", range(8), tenant="c", isolation=SP, immutable=8, extra_tokens=0), w0, 201.0)
    assert d is not None and d.shared_prefix_blocks == 0
    lines = p.drain_promotion_events()
    assert any(line.startswith("demote chain=") for line in lines)
    assert all("chain=" in line and len(line.split("chain=")[1].split()[0]) == 16 for line in lines)


def test_policy_file_isolation_is_never_weakened_by_the_request() -> None:
    shared = SharedSettings(
        promotion=PromotionConfig(min_tenants=1),
        tenants={"locked": TenantSettings(isolation=Isolation.STRICT)},
    )
    p = CostPolicy(seed=0, shared=shared)
    d = p.select(
        req("r", range(8), tenant="locked", isolation=Isolation.PUBLIC, immutable=8), workers(0), 0.0
    )
    assert d is not None and d.shared_prefix_blocks == 0
    assert p.stats().counters["public_promotions"] == 0


def test_per_tenant_index_share() -> None:
    from policies.index import IndexConfig
    from policies.pools import PoolSettings

    shared = SharedSettings(
        default_pool=PoolSettings(index=IndexConfig(max_entries=1000)),
        tenants={"small": TenantSettings(index_share=0.02)},
    )
    p = CostPolicy(seed=0, shared=shared)
    w0 = [WorkerView(WorkerId("w0"))]
    for i in range(10):
        _run(p, req(f"s{i}", range(i * 10, i * 10 + 10), tenant="small"), w0, float(i))
        _run(p, req(f"b{i}", range(i * 10, i * 10 + 10), tenant="big"), w0, float(i))
    by_ns = p.stats().index["p"].keys_by_namespace
    assert by_ns["small"] == 20 and by_ns["big"] == 100
    p.check_invariants()


# -- property: no cross-tenant matches, promotion only under the rules -----------------------------


_TENANTS = {
    "a": Isolation.STRICT,
    "b": Isolation.SHARED_PUBLIC,
    "c": Isolation.SHARED_PUBLIC,
    "d": Isolation.STRICT,
}


def _common(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(sorted(_TENANTS)), st.integers(0, 3), st.integers(0, 6)), max_size=40)
)
def test_matches_come_only_from_own_history_or_promoted_public_chains(
    steps: list[tuple[str, int, int]],
) -> None:
    p = _policy(min_tenants=2, window_s=1e9)
    views = workers(0, 0, 0)
    history: dict[str, list[list[int]]] = {t: [] for t in _TENANTS}
    public_history: list[list[int]] = []
    presenters: dict[tuple[int, ...], set[str]] = {}
    for i, (tenant, family, extra) in enumerate(steps):
        blocks = [family * 100 + j for j in range(4)] + [1000 * i + j for j in range(extra)]
        iso = _TENANTS[tenant]
        # extra == 0: the prompt is exactly the 4 immutable blocks (wholly public once promoted).
        r = req(f"r{i}", blocks, tenant=tenant, isolation=iso, immutable=4, extra_tokens=1 if extra else 0)
        chain_id = tuple(blocks[:4])
        if iso is not Isolation.STRICT:
            presenters.setdefault(chain_id, set()).add(tenant)
        promoted = len(presenters.get(chain_id, ())) >= 2 and iso is not Isolation.STRICT
        d = p.select(r, views, float(i))
        assert d is not None
        wholly_public = promoted and extra == 0
        if wholly_public:  # public salt: only public holdings can serve it
            best = max((_common(blocks[:4], h) for h in public_history), default=0)
        else:  # its tenant's salt: only its own history can
            best = max((_common(blocks, h) for h in history[tenant]), default=0)
        assert d.matched_tokens <= best * 16
        assert d.shared_prefix_blocks == (4 if wholly_public else 0)
        p.on_dispatch(r, d, float(i))
        if wholly_public:
            public_history.append(blocks[:4])
        else:
            history[tenant].append(blocks)
    p.check_invariants()
