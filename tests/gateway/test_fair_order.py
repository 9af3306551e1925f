"""The fair order of a pool's waiting requests: weighted across tenants, priority within one."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fair_order import Entry, FairOrder


def _drain(order: FairOrder[str], n: int | None = None) -> list[str]:
    out = []
    while n is None or len(out) < n:
        entry = order.pop()
        if entry is None:
            break
        out.append(entry.item)
    order.check_invariants()
    return out


def test_equal_tenants_alternate_whoever_came_first() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(6):
        order.push("heavy", 1.0, 0, f"h{i}")
    for i in range(2):
        order.push("light", 1.0, 0, f"l{i}")
    assert _drain(order) == ["h0", "l0", "h1", "l1", "h2", "h3", "h4", "h5"]


def test_weights_share_the_turns() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(200):
        order.push("a", 1.0, 0, f"a{i}")
        order.push("b", 3.0, 0, f"b{i}")
    first = Counter(item[0] for item in _drain(order, 200))
    assert abs(first["a"] - 50) <= 1 and first["a"] + first["b"] == 200


def test_a_newcomer_is_served_within_a_turn_of_a_long_flood() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(1000):
        order.push("flood", 1.0, 0, f"f{i}")
    _drain(order, 500)
    order.push("light", 1.0, 0, "l")
    assert "l" in _drain(order, 2)


def test_an_idle_tenant_banks_no_credit() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(100):
        order.push("a", 1.0, 0, f"a{i}")
    _drain(order, 90)  # a was served alone for a long time; b was idle meanwhile
    for i in range(10):
        order.push("b", 1.0, 0, f"b{i}")
    assert [item[0] for item in _drain(order, 10)] == ["a", "b"] * 5  # alternation, not a burst of b


def test_priority_orders_a_tenant_and_arrival_breaks_ties() -> None:
    order: FairOrder[str] = FairOrder()
    for priority, name in ((5, "p5"), (0, "p0-first"), (-3, "p-3"), (0, "p0-second")):
        order.push("t", 1.0, priority, name)
    assert _drain(order) == ["p-3", "p0-first", "p0-second", "p5"]


def test_priority_never_takes_another_tenants_turn() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(3):
        order.push("a", 1.0, 0, f"a{i}")
    for i in range(3):
        order.push("b", 1.0, -100, f"b{i}")  # urgent to b, not to everyone
    assert [item[0] for item in _drain(order)] == ["a", "b", "a", "b", "a", "b"]


def test_removed_items_are_never_served_and_leave_no_trace() -> None:
    order: FairOrder[str] = FairOrder()
    entries = [order.push("t", 1.0, 0, f"x{i}") for i in range(10)]
    gone = order.push("other", 1.0, 0, "gone")
    for entry in entries[::2]:
        order.remove(entry)
    order.remove(gone)
    order.remove(gone)  # twice is a no-op
    order.check_invariants()
    assert len(order) == 5 and order.depth("other") == 0
    assert _drain(order) == ["x1", "x3", "x5", "x7", "x9"]
    assert order.pop() is None


def test_an_item_put_back_keeps_its_place_in_its_tenant() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(3):
        order.push("t", 1.0, 0, f"x{i}")
    first = order.pop()
    assert first is not None and first.item == "x0"
    order.restore(first, 1.0)
    assert _drain(order) == ["x0", "x1", "x2"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "pop", "remove"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(-2, 2),
        ),
        max_size=120,
    )
)
def test_every_item_is_served_once_or_removed(ops: list[tuple[str, str, int]]) -> None:
    order: FairOrder[int] = FairOrder()
    weights = {"a": 1.0, "b": 0.5, "c": 4.0}
    live: dict[int, Entry[int]] = {}
    served: list[int] = []
    n = 0
    for op, tenant, priority in ops:
        if op == "push":
            live[n] = order.push(tenant, weights[tenant], priority, n)
            n += 1
        elif op == "pop":
            entry = order.pop()
            assert (entry is None) == (not live)
            if entry is not None:
                served.append(live.pop(entry.item).item)
        elif live:
            key = sorted(live)[priority % len(live)]
            order.remove(live.pop(key))
        order.check_invariants()
        assert len(order) == len(live)
    rest = []
    while (entry := order.pop()) is not None:
        rest.append(entry.item)
    assert sorted(rest) == sorted(live) and not set(served) & set(rest)
