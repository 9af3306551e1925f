"""The holder map's order of last use and its recorded times agree whatever clock a caller passes:
admission pins a follow-up with the time its request started (`admission.admit` -> `pin`), which
may be earlier than another request's use of another id since (the body read and its prompt keyed
in between). Before, such a refresh moved the id to the newest end of the order with an older time
than ids before it: the order was no longer that of last use (`check_invariants`: eviction reads
expiry from its oldest end), and the id expired `ttl_s` after the request's start, not its use."""

from __future__ import annotations

from gateway.responses_affinity import ResponseAffinity
from gateway.responses_ids import ResponseIds
from policies.base import WorkerId

IDS = ResponseIds(b"holder-clock")
W = WorkerId("http://w")


def test_a_refresh_with_a_lagging_clock_keeps_the_order_of_last_use() -> None:
    affinity = ResponseAffinity(max_entries=4, ttl_s=100.0, tenants=2, ids=IDS)
    a, b, c = IDS.mint("t"), IDS.mint("t"), IDS.mint("u")
    affinity.learn(a, "t", "p", W, 10.0)
    affinity.learn(b, "t", "p", W, 20.0)
    affinity.learn(c, "u", "p", W, 30.0)
    held = affinity.holder(a, "t", 15.0)  # a request that started at 15 s, pinned after 30 s
    assert held is not None and held.used_s == 30.0
    affinity.check_invariants()
    # Forgotten `ttl_s` after that use, not after the request's start.
    assert affinity.holder(a, "t", 120.0) is not None
    affinity.check_invariants()
