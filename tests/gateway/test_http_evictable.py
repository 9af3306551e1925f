"""`http_guard.Evictable`, the connections a full table may close for a new one: which it gives up
(the address holding the most, the connection there evictable longest), against a model that scans
everything, and its invariants after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from gateway.http_guard import Evictable


@dataclass(eq=False)
class Conn:
    """A connection as the guard sees it (`http_guard.Guarded`); only its identity matters here."""

    name: str
    deadline_s: float = 0.0
    send_deadline_s: float = 0.0
    capped: bool = True

    def expire(self) -> None: ...

    def expire_send(self) -> None: ...

    def evict(self) -> None: ...

    def evict_stalled(self) -> None: ...


def test_the_address_holding_the_most_gives_up_its_oldest_first() -> None:
    evictable = Evictable()
    a1, b1, a2, b2, a3, c1 = (Conn(n) for n in ("a1", "b1", "a2", "b2", "a3", "c1"))
    for conn in (a1, b1, a2, b2, a3, c1):
        evictable.add(conn, conn.name[0])
    assert evictable.pop() is a1  # a holds 3, b 2, c 1
    assert evictable.pop() is b1  # a and b hold 2: b held them first
    assert evictable.pop() is a2  # a holds 2, b and c 1
    # Each holds 1: c since it took c1, b and a only since they gave one up.
    assert [evictable.pop() for _ in range(3)] == [c1, b2, a3]
    assert evictable.pop() is None and not evictable
    evictable.check_invariants()


def test_a_connection_added_again_keeps_its_place_and_one_taken_out_is_never_given() -> None:
    evictable = Evictable()
    first, second = Conn("first"), Conn("second")
    evictable.add(first, "a")
    evictable.add(second, "a")
    evictable.add(first, "a")  # no change
    evictable.discard(second, "a")
    evictable.discard(second, "a")  # no change
    assert evictable.held_by("a") == 1 and evictable.pop() is first and evictable.pop() is None
    evictable.check_invariants()


@dataclass
class Model:
    """What `Evictable` gives up, found by scanning: each address's connections in the order
    they came, and when its count last changed (the order of addresses holding as many)."""

    held: dict[str, list[Conn]] = field(default_factory=dict)
    since: dict[str, int] = field(default_factory=dict)
    clock: int = 0

    def add(self, conn: Conn, address: str) -> None:
        if conn not in self.held.setdefault(address, []):
            self.held[address].append(conn)
            self._changed(address)

    def discard(self, conn: Conn, address: str) -> None:
        if conn in self.held.get(address, []):
            self.held[address].remove(conn)
            self._changed(address)

    def pop(self) -> Conn | None:
        holding = [a for a, conns in self.held.items() if conns]
        if not holding:
            return None
        most = max(len(self.held[a]) for a in holding)
        address = min((a for a in holding if len(self.held[a]) == most), key=lambda a: self.since[a])
        conn = self.held[address].pop(0)
        self._changed(address)
        return conn

    def _changed(self, address: str) -> None:
        self.clock += 1
        self.since[address] = self.clock


CONNS = [Conn(f"c{i}") for i in range(12)]
ADDRESSES = ["a", "b", "c"]


def address_of(conn: Conn) -> str:
    return ADDRESSES[CONNS.index(conn) % len(ADDRESSES)]


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(CONNS)),
        st.tuples(st.just("discard"), st.sampled_from(CONNS)),
        st.tuples(st.just("pop"), st.none()),
    ),
    max_size=80,
)


@given(operations)
def test_it_gives_up_what_a_full_scan_would(steps: list[tuple[str, Conn | None]]) -> None:
    evictable, model = Evictable(), Model()
    for op, conn in steps:
        if conn is None:
            assert evictable.pop() is model.pop()
        elif op == "add":
            evictable.add(conn, address_of(conn))
            model.add(conn, address_of(conn))
        else:
            evictable.discard(conn, address_of(conn))
            model.discard(conn, address_of(conn))
        evictable.check_invariants()
        held = {a: len(conns) for a, conns in model.held.items() if conns}
        assert {a: evictable.held_by(a) for a in ADDRESSES if evictable.held_by(a)} == held
