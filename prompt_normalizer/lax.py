"""Request fields read as vLLM reads them: pydantic v2's lax mode.

vLLM's request models are pydantic v2 models in lax mode, validated from the decoded JSON
(python mode), so a `bool` field takes `true`, `1`, `1.0`, `"yes"`, `"on"` and the like, and an
`int` field takes `2`, `2.0`, `"2"`, `true`. A gateway that refused what the worker takes would
turn working requests into 400s; one that read `"stream": "true"` as "no stream" would relay a
stream as if it were one answer. So the few fields read here are read by pydantic itself, with
the same rules as the engine, only for a value that is not already of the exact type (a real
`bool` or `int` costs one type test).
"""

from __future__ import annotations

from typing import Final

from pydantic import TypeAdapter, ValidationError

_BOOL: Final = TypeAdapter(bool)
_INT: Final = TypeAdapter(int)


def lax_bool(value: object) -> bool | None:
    """`value` as a lax pydantic `bool` field reads it (`True`/`False`, 0 and 1, 0.0 and 1.0,
    and case-insensitive `"true"`/`"false"`, `"1"`/`"0"`, `"yes"`/`"no"`, `"on"`/`"off"`,
    `"t"`/`"f"`, `"y"`/`"n"`); None when lax mode refuses it."""
    if value is True or value is False:
        return value
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return None


def lax_int(value: object) -> int | None:
    """`value` as a lax pydantic `int` field reads it (ints, `True`/`False` as 1/0, integral
    finite floats such as 2.0, and strings of an integer such as `"2"`, `" 2 "`, `"2.0"`);
    None when lax mode refuses it (2.5, `"two"`, a list...)."""
    if value.__class__ is int:
        return value
    try:
        return _INT.validate_python(value)
    except ValidationError:
        return None
