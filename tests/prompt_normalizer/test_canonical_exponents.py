"""A short literal with an exponent of three digits or more may leave a double's normal range:
`1e-400` reads as 0.0 and `2.5e-324` as the subnormal `5e-324`. Canonical JSON keeps such a
string as sent, and canonicalizes one whose numbers come back with their value (`1e-310`)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_normalizer.switches import canonical_json_text


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1e-400}',
        '{"b": 1, "a": 2.5e-324}',
        '[1, {"x": 2.5E-324}]',
        '{"a": 3e-0330}',
        '{"a": -7e-325, "b": "x"}',
    ],
)
def test_an_exponent_that_leaves_the_normal_range_keeps_the_string(text: str) -> None:
    assert canonical_json_text(text) is None


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ('{"b": 1e-310, "a": 1E+300}', '{"a":1e+300,"b":1e-310}'),
        ('{"b": 5e-324, "a": 1.7976931348623157e308}', '{"a":1.7976931348623157e+308,"b":5e-324}'),
        ('{"b": "123e4567-e89b 5e-123", "a": 1}', '{"a":1,"b":"123e4567-e89b 5e-123"}'),  # digits in a string
    ],
)
def test_an_exponent_that_keeps_its_value_is_canonicalized(text: str, canonical: str) -> None:
    assert canonical_json_text(text) == canonical


EXPONENT_LITERALS = st.from_regex(
    r"-?[1-9](\.[0-9]{1,3})?[eE][-+]?(3[0-3][0-9]|[0-9]{1,2}|4[0-9]{2})", fullmatch=True
)


@settings(max_examples=300, deadline=None)
@given(literals=st.lists(EXPONENT_LITERALS, min_size=1, max_size=4))
def test_a_canonical_text_never_changes_a_short_literal(literals: list[str]) -> None:
    text = "[" + ", ".join(literals) + "]"
    canonical = canonical_json_text(text)
    if canonical is not None:
        assert json.loads(canonical, parse_float=Decimal) == json.loads(text, parse_float=Decimal)
    exact = [Decimal(literal) for literal in literals]
    assert (canonical is None) == any(Decimal(repr(float(x))) != x for x in exact)
