"""Inconclusive SGLang pairs settled by the pairs served after them."""

from __future__ import annotations

from gateway.config.pool import PoolConfig
from gateway.pd_suspects import MAX_NOTES, NOTE_TTL_S, SERVED_WITHIN_S, InconclusivePairs
from gateway.worker import Worker

CONFIG = PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])


def _workers(*names: str) -> list[Worker]:
    return [Worker(f"http://{name}:8000", CONFIG) for name in names]


def test_a_served_pair_blames_the_other_worker_of_a_noted_pair_once_per_failed_round() -> None:
    p1, p2, d1, d2 = _workers("p1", "p2", "d1", "d2")
    pairs = InconclusivePairs()
    pairs.note(p1, d1, 0.0)
    pairs.note(p1, d1, 1.0)
    assert pairs.served(p2.worker_id, d2.worker_id, 2.0) == []  # shares no worker: nothing shown
    assert pairs.served(p1.worker_id, d2.worker_id, 3.0) == [d1]  # p1 works: d1 was at fault
    assert d1.breaker.failures == 2 and p1.breaker.failures == 0 and len(pairs) == 0
    pairs.note(p2, d2, 4.0)
    assert pairs.served(p1.worker_id, d2.worker_id, 5.0) == [p2]  # d2 works: p2 was at fault
    assert p2.breaker.failures == 1


def test_a_pair_served_whole_clears_its_note_and_old_notes_expire() -> None:
    p1, d1, d2 = _workers("p1", "d1", "d2")
    pairs = InconclusivePairs()
    pairs.note(p1, d1, 0.0)
    assert pairs.served(p1.worker_id, d1.worker_id, 1.0) == [] and len(pairs) == 0
    pairs.note(p1, d1, 0.0)
    assert pairs.served(p1.worker_id, d2.worker_id, NOTE_TTL_S + 1) == [] and d1.breaker.failures == 0


def test_notes_are_bounded_and_an_open_breaker_is_left_as_it_is() -> None:
    d1, d2 = _workers("d1", "d2")
    prefills = _workers(*(f"p{i}" for i in range(MAX_NOTES + 10)))
    pairs = InconclusivePairs()
    for p in prefills:
        for _ in range(5):
            pairs.note(p, d1, 0.0)
    assert len(pairs) == MAX_NOTES
    blamed = pairs.served(prefills[-1].worker_id, d2.worker_id, 1.0)
    assert blamed == [d1] and not d1.breaker.closed  # 5 rounds: open at the threshold (3)
    assert d1.breaker.failures == 3  # no failure counted on the open breaker
    assert pairs.served(prefills[0].worker_id, d2.worker_id, 1.0) == []  # forgotten (bounded)


def test_a_pair_whose_one_worker_served_lately_blames_the_other_at_once() -> None:
    p1, p2, d1, d2 = _workers("p1", "p2", "d1", "d2")
    pairs = InconclusivePairs()
    pairs.served(p1.worker_id, d2.worker_id, 0.0)
    assert pairs.note(p1, d1, 1.0) is d1 and d1.breaker.failures == 1  # p1 served a pair lately
    assert pairs.note(p2, d2, 2.0) is p2 and p2.breaker.failures == 1  # d2 did
    assert pairs.note(p1, d2, 3.0) is None and len(pairs) == 1  # both did: noted, no verdict
    assert pairs.note(p2, d1, 4.0) is None  # neither did
    assert pairs.note(p1, d1, SERVED_WITHIN_S + 1) is None  # too long ago to count
