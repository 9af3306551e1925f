"""Canonical JSON sorts a tool schema's keys but keeps the order of its `properties`: constrained
decoding writes an object's properties in the order the schema lists them, so that order is part
of what the client asked for."""

from __future__ import annotations

from typing import Any

import orjson

from prompt_normalizer.canonical import canonicalize_chat
from prompt_normalizer.normalizer import NormalizerConfig
from prompt_normalizer.switches import sort_keys

KEY = b"k" * 32


def tool(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties), **extra}
    return {"type": "function", "function": {"name": "answer", "parameters": parameters}}


def chat_tools(tools: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    canonical = canonicalize_chat(body, NormalizerConfig(), KEY)
    assert canonical.tools is not None
    return canonical.tools


def test_the_properties_keep_their_order_and_everything_else_is_sorted() -> None:
    reasoning_first = tool(
        {
            "reasoning": {"type": "string", "description": "think first"},
            "answer": {"description": "then answer", "type": "integer"},
        }
    )
    (out,) = chat_tools([reasoning_first])
    parameters = out["function"]["parameters"]
    assert list(out) == ["function", "type"] and list(out["function"]) == ["name", "parameters"]
    assert list(parameters) == ["properties", "required", "type"]
    assert list(parameters["properties"]) == ["reasoning", "answer"]  # as the client listed them
    assert list(parameters["properties"]["answer"]) == ["description", "type"]  # inside: sorted
    assert parameters["required"] == ["reasoning", "answer"]


def test_nested_objects_keep_their_properties_order_and_a_property_named_properties_is_a_schema() -> None:
    schema = tool(
        {
            "zeta": {
                "type": "object",
                "properties": {"second": {"type": "string"}, "first": {"type": "string"}},
            },
            "properties": {"type": "string", "description": "a field that happens to be called so"},
        }
    )
    (out,) = chat_tools([schema])
    props = out["function"]["parameters"]["properties"]
    assert list(props) == ["zeta", "properties"]
    assert list(props["zeta"]["properties"]) == ["second", "first"]
    assert list(props["properties"]) == ["description", "type"]  # the field's own schema: sorted


def test_schemas_that_differ_only_in_keyword_order_become_one_and_property_order_still_counts() -> None:
    a = tool({"q": {"type": "string"}, "n": {"type": "integer"}})
    b = {
        "function": {
            "parameters": {
                "required": ["q", "n"],
                "properties": a["function"]["parameters"]["properties"],
                "type": "object",
            },
            "name": "answer",
        },
        "type": "function",
    }
    swapped = tool({"n": {"type": "integer"}, "q": {"type": "string"}}, required=["q", "n"])
    dump = orjson.dumps
    assert dump(chat_tools([a])[0]) == dump(chat_tools([b])[0])
    assert dump(chat_tools([a])[0]) != dump(chat_tools([swapped])[0])


def test_sort_keys_reports_a_change_only_where_it_reordered() -> None:
    kept = {"properties": {"b": {"type": "string"}, "a": {"type": "string"}}, "type": "object"}
    assert sort_keys(kept) == (kept, False)
    value, changed = sort_keys({"type": "object", "properties": {"b": {"type": "string"}}})
    assert changed and list(value) == ["properties", "type"]


def test_property_order_sort_sorts_the_properties_too_for_clients_whose_order_drifts() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool({"b": {"type": "string"}, "a": {}})],
    }
    canonical = canonicalize_chat(body, NormalizerConfig(property_order="sort"), KEY)
    assert canonical.tools is not None
    assert list(canonical.tools[0]["function"]["parameters"]["properties"]) == ["a", "b"]
