"""A public-namespace match saves prefill only when the request will carry the public salt.

The gateway gives a request the public `cache_salt` only when its tenant is not strict and the
promoted public blocks the policy routed cover every prompt token (`policies.identity`); vLLM's salt
covers the whole chain, so any other request is served only from its own tenant's KV.
"""

from __future__ import annotations

import dataclasses

import pytest

from policies.base import Isolation, Observation, Outcome, RouteDecision, RouteRequest
from policies.cost_policy import CostPolicy
from policies.prefix_policy import SharedSettings
from policies.tenants import PromotionConfig, wholly_public_blocks
from prompt_normalizer.types import PUBLIC_NAMESPACE
from tests.policies.factories import BS, chain, req, workers

SP = Isolation.SHARED_PUBLIC


@pytest.mark.parametrize(
    ("n_blocks", "extra_tokens", "immutable", "isolation", "n_public", "expected"),
    [
        (8, 0, 8, SP, 8, 8),  # exactly the promoted blocks
        (8, 0, 8, Isolation.PUBLIC, 8, 8),
        (7, 10, 8, SP, 8, 8),  # a partial last block still inside the promoted blocks
        (8, 1, 8, SP, 8, 0),  # one token past them: the tenant's salt
        (12, 0, 8, SP, 8, 0),
        (8, 0, 8, Isolation.STRICT, 8, 0),  # strict tenants never share
        (8, 0, 8, SP, 0, 0),  # not promoted
        (8, 0, 4, SP, 8, 0),  # more blocks claimed than the request has public keys
    ],
)
def test_the_wholly_public_rule_on_hand_made_cases(
    n_blocks: int, extra_tokens: int, immutable: int, isolation: Isolation, n_public: int, expected: int
) -> None:
    r = req("r", range(n_blocks), isolation=isolation, immutable=immutable, extra_tokens=extra_tokens)
    if n_blocks < immutable:  # public keys may cover a trailing partial block
        r = dataclasses.replace(r, public_block_keys=chain(PUBLIC_NAMESPACE, range(immutable)))
    assert wholly_public_blocks(r, isolation, n_public) == expected


def _policy(min_tenants: int) -> CostPolicy:
    return CostPolicy(seed=1, shared=SharedSettings(promotion=PromotionConfig(min_tenants=min_tenants)))


def _serve(p: CostPolicy, r: RouteRequest, now: float, n_workers: int = 4) -> RouteDecision:
    d = p.select(r, workers(*([0] * n_workers)), now)
    assert d is not None
    p.on_dispatch(r, d, now)
    p.on_complete(Observation(r, d.worker, prompt_tokens=r.n_prompt_tokens), now + 0.5)
    return d


def test_promotion_does_not_lag_requests_past_the_prefix_claim_no_public_hits() -> None:
    # The reported lag: with min_tenants 2, the second tenant promotes the chain but its prompt runs
    # past it (tenant salt). The third tenant's wholly public request must not be routed as a hit
    # on that worker: nobody computed the chain under the public salt yet.
    p = _policy(min_tenants=2)
    _serve(p, req("a", range(12), tenant="a", isolation=SP, immutable=8), 0.0)
    d_b = _serve(p, req("b", range(12), tenant="b", isolation=SP, immutable=8), 1.0)
    assert p.stats().counters["public_promotions"] == 1
    assert d_b.shared_prefix_blocks == 0  # the gateway salts it per tenant, and the policy agrees
    c = req("c", range(8), tenant="c", isolation=SP, immutable=8, extra_tokens=0)
    d_c = _serve(p, c, 2.0)
    assert d_c.shared_prefix_blocks == 8 and d_c.reason == "miss" and d_c.matched_tokens == 0
    # Now a worker holds the chain under the public salt: the next wholly public request hits it.
    d_d = _serve(p, req("d", range(8), tenant="d", isolation=SP, immutable=8, extra_tokens=0), 3.0)
    assert d_d.worker == d_c.worker and d_d.reason == "hit" and d_d.matched_tokens == 7 * BS
    p.check_invariants()


def test_a_request_dispatched_before_promotion_keeps_its_tenant_salt_when_it_completes() -> None:
    p = _policy(min_tenants=2)
    a = req("a", range(8), tenant="a", isolation=SP, immutable=8, extra_tokens=0)
    d_a = p.select(a, workers(0, 0, 0, 0), 0.0)
    assert d_a is not None and d_a.shared_prefix_blocks == 0
    p.on_dispatch(a, d_a, 0.0)
    # Tenant b promotes the chain while a's request is still running (and is served elsewhere).
    b = req("b", range(8), tenant="b", isolation=SP, immutable=8, extra_tokens=0)
    d_b = p.select(b, [v for v in workers(0, 0, 0, 0) if v.worker_id != d_a.worker], 0.1)
    assert d_b is not None and d_b.shared_prefix_blocks == 8 and d_b.worker != d_a.worker
    p.on_dispatch(b, d_b, 0.1)
    p.on_complete(Observation(a, d_a.worker, prompt_tokens=a.n_prompt_tokens), 0.5)
    p.on_complete(Observation(b, d_b.worker, prompt_tokens=b.n_prompt_tokens), 0.5)
    # a's worker computed under a's salt: only b's worker holds the public chain.
    c = req("c", range(8), tenant="c", isolation=SP, immutable=8, extra_tokens=0)
    d_c = p.select(c, workers(0, 0, 0, 0), 1.0)
    assert d_c is not None and d_c.worker == d_b.worker and d_c.reason == "hit"
    # ...and a's own follow-up still finds its tenant-salted blocks only where it ran.
    a2 = req("a2", range(10), tenant="a", isolation=SP, immutable=8)
    d_a2 = p.select(a2, workers(0, 0, 0, 0), 1.0)
    assert d_a2 is not None and d_a2.worker == d_a.worker and d_a2.matched_tokens == 8 * BS


def test_a_wholly_public_request_does_not_count_its_tenant_salted_blocks() -> None:
    p = _policy(min_tenants=1)
    # Tenant a's long prompt runs past the promoted prefix: its worker holds it under a's salt.
    d_long = _serve(p, req("a1", range(20), tenant="a", isolation=SP, immutable=8), 0.0)
    assert d_long.shared_prefix_blocks == 0
    # a's next request is wholly public: it will carry the public salt, so a's own blocks save
    # nothing and no worker holds the public chain yet.
    d = p.select(
        req("a2", range(8), tenant="a", isolation=SP, immutable=8, extra_tokens=0), workers(0, 0), 1.0
    )
    assert d is not None and d.shared_prefix_blocks == 8 and d.matched_tokens == 0 and d.reason == "miss"


def _public_tenant(rid: str, tenant: str, blocks: range) -> RouteRequest:
    # The simulator's shape for a `public` tenant: keys in the public namespace, no public twin.
    return req(rid, blocks, tenant=tenant, namespace=PUBLIC_NAMESPACE, isolation=Isolation.PUBLIC)


def test_public_tenants_keyed_in_the_public_namespace_match_only_their_own_salted_blocks() -> None:
    p = _policy(min_tenants=3)
    d_a = _serve(p, _public_tenant("a1", "a", range(20)), 0.0)
    # Same keys, another tenant: its own salt, so a's worker cannot serve it.
    d_b = p.select(_public_tenant("b1", "b", range(24)), workers(0, 0, 0, 0), 1.0)
    assert d_b is not None and d_b.matched_tokens == 0 and d_b.shared_prefix_blocks == 0
    # The same tenant does reuse its own blocks.
    d_a2 = p.select(_public_tenant("a2", "a", range(24)), workers(0, 0, 0, 0), 1.0)
    assert d_a2 is not None and d_a2.worker == d_a.worker and d_a2.matched_tokens == 20 * BS
    # An unsalted request in the public namespace (not a public tenant) does not see a's blocks.
    plain = req("u", range(24), tenant="u", namespace=PUBLIC_NAMESPACE)
    d_u = p.select(plain, workers(0, 0, 0, 0), 1.0)
    assert d_u is not None and d_u.matched_tokens == 0
    p.check_invariants()


def test_a_failed_request_takes_back_its_public_holding() -> None:
    p = _policy(min_tenants=1)
    r = req("a", range(8), tenant="a", isolation=SP, immutable=8, extra_tokens=0)
    d = p.select(r, workers(0, 0), 0.0)
    assert d is not None and d.shared_prefix_blocks == 8
    p.on_dispatch(r, d, 0.0)
    p.on_complete(Observation(r, d.worker, prompt_tokens=0, outcome=Outcome.REJECTED), 0.1)
    d2 = p.select(
        req("b", range(8), tenant="b", isolation=SP, immutable=8, extra_tokens=0), workers(0, 0), 0.2
    )
    assert d2 is not None and d2.matched_tokens == 0
