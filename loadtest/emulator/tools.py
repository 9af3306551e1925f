"""Deterministic tool calls: which tool to call and arguments built from its JSON schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from loadtest.emulator.errors import ApiError

_MAX_DEPTH = 4


def _tool_name(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError.bad_request("each tool needs function.name", f"tools[{i}].function.name")
    return str(fn["name"])


def choose_tool(tools: Any, tool_choice: Any, messages: list[Any]) -> Mapping[str, Any] | None:
    """The tool to call, or None for a text answer.

    A call is made when tools are given, `tool_choice` is not "none" and the last message is the
    user's: the named tool if `tool_choice` names one, else the first tool.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError.bad_request("tools must be a list", "tools")
    names = [_tool_name(t, i) for i, t in enumerate(tools)]
    if not tools or tool_choice == "none":
        return None
    if tool_choice not in (None, "auto", "required") and not isinstance(tool_choice, Mapping):
        raise ApiError.bad_request(
            'tool_choice must be "none", "auto", "required" or an object', "tool_choice"
        )
    last = messages[-1] if messages else None
    if not isinstance(last, Mapping) or last.get("role") != "user":
        return None
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        wanted = fn.get("name") if isinstance(fn, Mapping) else None
        if wanted not in names:
            raise ApiError.bad_request(f"tool_choice names an unknown tool {wanted!r}", "tool_choice")
        chosen: Mapping[str, Any] = tools[names.index(str(wanted))]
        return chosen
    first: Mapping[str, Any] = tools[0]
    return first


def example_value(schema: Any, name: str = "", depth: int = 0) -> Any:
    """A deterministic value that satisfies the common parts of a JSON schema."""
    if not isinstance(schema, Mapping):
        return "example"
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    if "default" in schema:
        return schema["default"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if kind is None and isinstance(options, list) and options:
            return example_value(options[0], name, depth + 1)
    if kind == "object" or (kind is None and "properties" in schema):
        return object_example(schema, depth + 1)
    if kind == "array":
        if depth >= _MAX_DEPTH:
            return []
        return [example_value(schema.get("items"), name, depth + 1)]
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.0))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return f"example {name}".strip() if name else "example"


def object_example(schema: Mapping[str, Any], depth: int = 0) -> dict[str, Any]:
    props = schema.get("properties")
    if not isinstance(props, Mapping) or depth > _MAX_DEPTH:
        return {}
    required = schema.get("required")
    keys = [k for k in props if not isinstance(required, list) or k in required] or list(props)
    return {str(k): example_value(props[k], str(k), depth + 1) for k in keys}


def tool_call_arguments(tool: Mapping[str, Any]) -> tuple[str, str]:
    """(function name, arguments JSON) for a call to `tool`."""
    fn = tool["function"]
    params = fn.get("parameters") if isinstance(fn, Mapping) else None
    args = object_example(params) if isinstance(params, Mapping) else {}
    return str(fn["name"]), orjson.dumps(args).decode()
