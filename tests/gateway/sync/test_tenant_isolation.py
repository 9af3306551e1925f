"""Replica sync never mixes tenants: a peer's holding is filed under its namespace, and only that
namespace's requests can find it, whatever keys it carries."""

from __future__ import annotations

import dataclasses

from gateway.sync.codec import SyncBatch
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerHolding, PeerItem
from tests.gateway.sync.signed import decode, encode
from tests.policies.factories import req, workers


class Outbox:
    """A sink that keeps what a policy published."""

    def __init__(self) -> None:
        self.items: list[PeerItem] = []

    def __call__(self, item: PeerItem, now_s: float) -> None:
        self.items.append(item)


def _policy(seed: int = 1) -> CostPolicy:
    return CostPolicy(seed=seed)


def _over_the_wire(out: Outbox, to: CostPolicy) -> None:
    """What `out` collected, encoded, decoded and applied as a peer batch would be."""
    batch = decode(encode(SyncBatch("a", 1, 0.0, False, tuple(out.items))), now_wall_s=0.0)
    for item in batch.items:
        to.apply_peer("a", item, 0.0)
    out.items.clear()


def test_another_tenants_same_prompt_is_no_hit_at_the_peer() -> None:
    a, b = _policy(), _policy(seed=7)
    out = Outbox()
    a.set_sync_sink(out)
    first = req("r0", range(64), tenant="alice")
    d = a.select(first, workers(0, 0, 0, 0), 0.0)
    assert d is not None
    a.on_dispatch(first, d, 0.0)
    _over_the_wire(out, b)
    other = b.select(req("r1", range(66), tenant="bob"), workers(0, 0, 0, 0), 0.1)
    assert other is not None and other.reason != "hit" and other.matched_tokens == 0
    same = b.select(req("r2", range(66), tenant="alice"), workers(0, 0, 0, 0), 0.1)
    assert same is not None and same.worker == d.worker and same.reason == "hit"


def test_a_holding_filed_under_one_namespace_never_matches_anothers_keys() -> None:
    # A peer (broken, or holding the deployment's secret) that sends bob's chain as alice's: the
    # entries are alice's, and bob's requests still find nothing.
    b = _policy()
    bob = req("r0", range(64), tenant="bob")
    d = b.select(bob, workers(0, 0, 0, 0), 0.0)
    assert d is not None
    forged = PeerHolding(
        1, "p", bob.block_size_tokens, "alice", bob.block_keys, d.worker, bob.n_prompt_tokens, 0
    )
    out = Outbox()
    out(forged, 0.0)
    _over_the_wire(out, b)
    again = b.select(dataclasses.replace(bob, request_id="r1"), workers(0, 0, 0, 0), 0.1)
    assert again is not None and again.reason != "hit" and again.matched_tokens == 0
    b.check_invariants()
