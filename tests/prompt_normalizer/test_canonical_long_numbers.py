"""Canonical JSON of a text full of long numbers (floats as languages print them, snowflake ids,
times in nanoseconds) costs about one more orjson round trip, not a second parse by the standard
library's reader: only a literal orjson would not write back as sent is looked at on its own, and
the slow exact reader runs only when one of them would change. The guarantee stays: a canonical
text never changes a number."""

from __future__ import annotations

import json
from decimal import Decimal

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_normalizer.switches import canonical_json_text

_INT_RANGE = range(-(2**63), 2**64)


def _sorted(text: str) -> str:
    return orjson.dumps(orjson.loads(text), option=orjson.OPT_SORT_KEYS).decode()


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"values": [0.1 + 0.2, 2 / 3, 1 / 7, 123456.78901234567], "unit": "m"}),
        json.dumps([{"id": 1733284800123456789, "ts_ns": 1733284800000000001, "ok": True}]),
        '{"b": -9223372036854775808, "a": 18446744073709551615, "c": 9999999999999999999}',
        # Printed otherwise by orjson (`1.5e-7`, `0.00001234...`), the same value: looked at alone.
        '{"b": 1.5e-07, "a": [1.2345678901234568e-05, 1e+22, 0.30000000000000004]}',
        '{"note": "2024-12-04T05:21:59.123456789+00:00 ----------------", "x": 0.30000000000000004}',
    ],
)
def test_long_numbers_orjson_keeps_skip_the_exact_reader(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def exact_reader(*args: object, **kwargs: object) -> object:
        raise AssertionError("the standard library's reader ran")

    monkeypatch.setattr(json, "loads", exact_reader)
    assert canonical_json_text(text) == _sorted(text)


def _changes(text: str) -> bool:
    """The oracle: whether orjson would change a number of `text` (every number read exactly)."""
    try:
        stack = [json.loads(text, parse_float=Decimal)]
    except ValueError:
        return True  # an integer past Python's digit limit
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, Decimal):
            if not value.is_finite() or Decimal(repr(float(value))) != value:
                return True
        elif isinstance(value, int) and not isinstance(value, bool) and value not in _INT_RANGE:
            return True
    return False


# Number literals as clients write them: integers of any length, mantissas of up to 25 digits,
# exponents of up to two digits; and doubles and ids as languages print them.
LITERALS = (
    st.from_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,25})?([eE][-+]?[0-9]{1,2})?", fullmatch=True)
    | st.floats(allow_nan=False, allow_infinity=False).map(repr)
    | st.integers(min_value=-(2**64), max_value=2**65).map(str)
)
STRINGS = st.text(alphabet="0123456789.eE+- x", max_size=30).map(json.dumps)


@settings(max_examples=400, deadline=None)
@given(items=st.lists(st.tuples(st.sampled_from("abcd"), LITERALS | STRINGS), min_size=1, max_size=8))
def test_a_text_is_canonicalized_exactly_when_no_number_changes(items: list[tuple[str, str]]) -> None:
    text = "{" + ", ".join(f'"{key}{i}": {value}' for i, (key, value) in enumerate(items)) + "}"
    canonical = canonical_json_text(text)
    assert (canonical is None) == _changes(text)
    if canonical is not None:
        assert json.loads(canonical, parse_float=Decimal) == json.loads(text, parse_float=Decimal)


def test_a_string_of_long_digits_is_no_number() -> None:
    """Digits in a string that would change as a number do not keep the text as sent."""
    text = '{"b": "98765432109876543210987 0.12345678901234567890", "a": 0.30000000000000004}'
    assert canonical_json_text(text) == _sorted(text)
