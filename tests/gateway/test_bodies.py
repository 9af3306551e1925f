"""What the edge checks in a request body before anything is routed (`gateway/bodies.py`)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.bodies import parse_body
from gateway.errors import ApiError
from gateway.routes import ROUTES

CHAT = ROUTES["/v1/chat/completions"]
COMPLETIONS = ROUTES["/v1/completions"]
EMBEDDINGS = ROUTES["/v1/embeddings"]


def _chat(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})


@pytest.mark.parametrize("n", [1, 2, 8])
def test_choices_within_the_limit_pass(n: int) -> None:
    assert parse_body(_chat(n=n), CHAT, max_choices=8)["n"] == n
    completions = orjson.dumps({"model": "m", "prompt": "x", "n": n, "best_of": n})
    assert parse_body(completions, COMPLETIONS, max_choices=8)["best_of"] == n


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (9, "integer_above_max_value"),
        (100_000, "integer_above_max_value"),
        (0, "invalid_request"),
        (-1, "invalid_request"),
        (2.5, "invalid_request"),  # lax mode reads 2.0, "2" and true; not these
        ("two", "invalid_request"),
        ([2], "invalid_request"),
        ("9", "integer_above_max_value"),
    ],
)
@pytest.mark.parametrize("field", ["n", "best_of"])
def test_choices_outside_the_limit_are_a_400_naming_the_field(value: Any, code: str, field: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(_chat(**{field: value}), CHAT, max_choices=8)
    assert info.value.status == 400 and info.value.param == field and info.value.code == code


def test_null_choices_are_the_default_and_other_routes_are_not_checked() -> None:
    assert parse_body(_chat(n=None), CHAT, max_choices=8)["n"] is None
    body = orjson.dumps({"model": "m", "input": "x", "n": 10_000})
    assert parse_body(body, EMBEDDINGS, max_choices=8)["n"] == 10_000  # the worker's to judge
