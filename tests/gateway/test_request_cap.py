"""`limits.max_in_flight_requests` and each tenant's share of it (`lifecycle.RequestCap`): a lone
tenant may use the whole cap; one that holds it cannot keep another from its share."""

from __future__ import annotations

import random

from gateway.lifecycle import RequestCap, TenantPlaces


def take(places: TenantPlaces, n: int) -> int:
    """How many of `n` places the tenant got."""
    return sum(places.take() for _ in range(n))


def test_a_lone_tenant_may_hold_the_whole_cap_and_no_more() -> None:
    cap = RequestCap(8)
    b = cap.tenant("b")
    assert take(b, 9) == 8
    assert cap.held == 8
    cap.check_invariants()


def test_a_tenant_arriving_at_a_full_cap_borrows_its_share_and_the_holder_waits_until_under_it() -> None:
    cap = RequestCap(8)
    a, b = cap.tenant("a"), cap.tenant("b")
    assert take(b, 8) == 8
    assert take(a, 5) == 4  # its share: 8 among two tenants
    assert cap.held == 12 and not b.take()
    for _ in range(4):  # the holder's requests end; it gets nothing back while over the cap
        b.give_back()
        assert not b.take() and not a.take()
    assert cap.held == 8
    b.give_back()  # under the cap: whoever asks first
    assert b.take()
    assert (a.held, b.held) == (4, 4)
    cap.check_invariants()


def test_shares_follow_the_tenants_weights_and_every_tenant_gets_at_least_one() -> None:
    cap = RequestCap(10, {"heavy": 4.0, "light": 1.0})
    heavy, light, other = cap.tenant("heavy"), cap.tenant("light"), cap.tenant("other")
    assert take(light, 10) == 10  # alone: the whole cap
    assert take(heavy, 10) == 8  # 10 × 4 / 5
    assert take(other, 10) == 1  # 10 × 1 / 6 is below one place: one all the same
    cap.check_invariants()


def test_past_the_cap_the_process_never_holds_more_than_twice_it() -> None:
    # Tenants that arrive one after another, each while the others hold theirs, would borrow
    # C/2 + C/3 + ... past the cap: the ceiling stops them at 2C.
    cap = RequestCap(6)
    tenants = [cap.tenant(str(i)) for i in range(12)]
    for places in tenants:
        take(places, 6)
    assert cap.held == 12
    assert [t.held for t in tenants[:4]] == [6, 3, 2, 1]
    cap.check_invariants()


def test_random_arrivals_and_ends_keep_the_books_and_the_bounds() -> None:
    rng = random.Random(7)
    cap = RequestCap(16, {"a": 1.0, "b": 2.0, "c": 0.5})
    tenants = [cap.tenant(name) for name in ("a", "b", "c", "d")]
    for _ in range(20_000):
        places = rng.choice(tenants)
        if places.held and rng.random() < 0.5:
            places.give_back()
            continue
        before, share = cap.held, cap.share(places)
        got = places.take()
        # Under the cap anyone gets a place; at or past it only a tenant below its share.
        assert got == (before < 16 or (places.held - got < share and before < 32))
        assert cap.held <= 32
    cap.check_invariants()
    for places in tenants:
        while places.held:
            places.give_back()
    assert cap.held == 0 and cap.active_units == 0
    cap.check_invariants()
