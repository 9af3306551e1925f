"""Canonical JSON (tool-call `arguments`, JSON tool results) never changes a value: a number
orjson would not keep exactly (an integer beyond 64 bits, a long mantissa) leaves its string as
it was, rather than reaching the model as a rounded float."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.switches import canonical_json_text
from prompt_normalizer.types import KeyIdentity

IDENT = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4)


@pytest.mark.parametrize(
    "text",
    [
        '{"id": 98765432109876543210987}',
        '{"b": 1, "a": 18446744073709551616}',  # one past the unsigned 64-bit range
        '{"b": 1, "a": -9223372036854775809}',  # one below the signed 64-bit range
        '{"b": 1, "a": [1, {"c": 123456789012345678901234567890}]}',
        '{"b": 1, "x": 0.12345678901234567890}',  # more digits than a double holds
        "[1" + "0" * 5000 + "]",  # past Python's own digit limit too
    ],
)
def test_a_number_orjson_would_change_keeps_the_string(text: str) -> None:
    assert canonical_json_text(text) is None


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ('{"b": 1, "a": 18446744073709551615}', '{"a":18446744073709551615,"b":1}'),
        ('{"b": 1, "a": -9223372036854775808}', '{"a":-9223372036854775808,"b":1}'),
        ('{"b": "98765432109876543210987", "a": 1}', '{"a":1,"b":"98765432109876543210987"}'),  # a string
        ('{"b": 0.1234567890123456, "a": 1.50}', '{"a":1.5,"b":0.1234567890123456}'),
        ('{"a": 1, "a": 2}', '{"a":2}'),  # the last of a repeated key, as every reader keeps it
    ],
)
def test_numbers_orjson_keeps_are_canonicalized(text: str, canonical: str) -> None:
    assert canonical_json_text(text) == canonical


def _exact(text: str) -> Any:
    return json.loads(text, parse_float=Decimal)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(st.text(max_size=3), JSON_VALUES, max_size=4))
def test_a_canonical_text_reads_as_the_same_values(value: dict[str, Any]) -> None:
    text = json.dumps(value)
    canonical = canonical_json_text(text)
    assert canonical is None or _exact(canonical) == _exact(text)


def _call(call_id: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": arguments}}


def test_tool_call_arguments_with_a_large_integer_reach_the_worker_as_sent() -> None:
    big = '{"id": 98765432109876543210987, "name": "x"}'
    calls = [_call("1", big), _call("2", '{"b": 1, "a": 2}')]
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "1", "content": big},
        ]
    }
    out = Normalizer(NormalizerConfig(), b"s").canonicalize("chat", body, IDENT)
    assert out.canonical_body is not None  # the small one was canonicalized
    messages = out.canonical_body["messages"]
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [big, '{"a":2,"b":1}']
    assert messages[2]["content"] == big
