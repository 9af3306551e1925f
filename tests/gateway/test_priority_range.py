"""`priority` beyond 64 bits is a 400 naming the field where the route's model has it, not an
encoding failure reported as deep nesting; where the model lacks it, it is neither checked nor
read (it counts as 0 in the gateway's queue)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.bodies import encode_body, parse_body
from gateway.errors import ApiError
from gateway.routes import ROUTES

BIG = ["99999999999999999999", "-9223372036854775809", "9223372036854775808", 1e20, 2**64, -(2**64)]


def _raw(route: str, priority: Any) -> bytes:
    # A JSON number beyond 64 bits, written as the client sends it.
    text = str(priority) if isinstance(priority, int) else orjson.dumps(priority).decode()
    if route == "/v1/embeddings":
        return f'{{"model": "m", "input": "x", "priority": {text}}}'.encode()
    return f'{{"model": "m", "messages": [{{"role": "user", "content": "x"}}], "priority": {text}}}'.encode()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/embeddings", "/v1/responses"])
@pytest.mark.parametrize("priority", BIG)
def test_a_priority_beyond_64_bits_is_a_400_naming_the_field(route: str, priority: Any) -> None:
    raw = _raw(route, priority)
    if route == "/v1/responses":
        raw = raw.replace(b'"messages": [{"role": "user", "content": "x"}]', b'"input": "x"')
    with pytest.raises(ApiError) as info:
        parse_body(raw, ROUTES[route])
    assert info.value.status == 400 and info.value.param == "priority"
    assert "nested" not in info.value.message


@pytest.mark.parametrize("priority", ["-9223372036854775808", "9223372036854775807", 2**63 - 1])
def test_the_ends_of_the_range_are_read(priority: Any) -> None:
    body = parse_body(_raw("/v1/chat/completions", priority), ROUTES["/v1/chat/completions"])
    assert body["priority"] == int(priority) and body["priority"].__class__ is int
    encode_body(body)


@pytest.mark.parametrize("priority", [*BIG, "3", -5, "high"])
def test_messages_neither_checks_nor_reads_priority(priority: Any) -> None:
    body = parse_body(_raw("/v1/messages", priority), ROUTES["/v1/messages"])
    assert "priority" not in body  # the queue reads 0; the worker gets the tenant's own or none
    assert orjson.loads(encode_body(body))["model"] == "m"


def test_an_integer_beyond_64_bits_is_not_called_deep_nesting() -> None:
    with pytest.raises(ApiError) as info:
        encode_body({"model": "m", "x": 2**64})
    assert info.value.status == 400 and "64 bits" in info.value.message
    assert "nested" not in info.value.message
