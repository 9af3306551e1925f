from __future__ import annotations

import dataclasses

import pytest

from policies.base import RouteDecision, WorkerId
from policies.records import record


@record
class _Point:
    x: int
    label: str = "p"


def test_a_record_is_a_slotted_value_object() -> None:
    p = _Point(1)
    assert p == _Point(1, "p") and p != _Point(2)
    assert hash(p) == hash(_Point(1, "p"))  # usable as a key, like a frozen dataclass
    assert not hasattr(p, "__dict__")
    with pytest.raises(AttributeError):
        p.extra = 1  # type: ignore[attr-defined]
    assert dataclasses.replace(p, x=3) == _Point(3)
    assert dataclasses.fields(RouteDecision)[0].name == "worker"
    d = RouteDecision(WorkerId("w"), 1.0, "hit", 16)
    assert {d: 1}[RouteDecision(WorkerId("w"), 1.0, "hit", 16)] == 1
