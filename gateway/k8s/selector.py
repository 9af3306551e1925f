"""Label selectors and port names as the Kubernetes API accepts them, checked when the config loads.

The API server would reject a malformed selector too, but only at run time and as an HTTP 400 in a
log line; checking here turns it into a config error naming the field. The grammar is that of
`kubectl get -l`: comma-separated requirements, each `key`, `!key`, `key=value`, `key==value`,
`key!=value`, `key in (a,b)`, `key notin (a,b)`, `key>N` or `key<N`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?"
_KEY = re.compile(rf"^(?:{_PREFIX}/)?{_NAME}$")
_VALUE = re.compile(rf"^(?:{_NAME})?$")
_EXISTS = re.compile(r"^(!?)\s*(\S+)$")
_COMPARE = re.compile(r"^(\S+?)\s*(==|!=|=|>|<)\s*(\S*)$")
_SET = re.compile(r"^(\S+)\s+(in|notin)\s*\((.*)\)$")
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){0,14}$")


def label_key_ok(key: str) -> bool:
    """A qualified label key: an optional DNS-subdomain prefix and `/`, then a name of up to 63."""
    return bool(_KEY.match(key)) and len(key.rsplit("/", 1)[-1]) <= 63


def _check_value(value: str, where: str) -> None:
    if len(value) > 63 or not _VALUE.match(value):
        raise ValueError(f"{where}: {value!r} is not a valid label value")


def _split(selector: str) -> list[str]:
    """Requirements separated by commas outside parentheses."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(selector[start:i])
            start = i + 1
    parts.append(selector[start:])
    return [p.strip() for p in parts]


def _check_requirement(req: str) -> None:
    if m := _SET.match(req):
        key, values = m.group(1), [v.strip() for v in m.group(3).split(",")]
        if not values or values == [""]:
            raise ValueError(f"{req!r}: `{m.group(2)}` needs at least one value")
        for v in values:
            _check_value(v, req)
    elif m := _COMPARE.match(req):
        key, op, value = m.groups()
        if op in (">", "<") and not value.isdigit():
            raise ValueError(f"{req!r}: `{op}` compares with a whole number")
        _check_value(value, req)
    elif m := _EXISTS.match(req):
        key = m.group(2)
    else:
        raise ValueError(f"{req!r} is not a label requirement")
    if not label_key_ok(key):
        raise ValueError(f"{req!r}: {key!r} is not a valid label key")


def normalize_selector(selector: str | Mapping[str, str]) -> str:
    """The selector as the API's `labelSelector` parameter; a mapping means equality on each key.

    An empty selector is refused: it would route to every pod of the namespace.
    """
    if isinstance(selector, Mapping):
        for key, value in selector.items():
            if not label_key_ok(str(key)):
                raise ValueError(f"{key!r} is not a valid label key")
            _check_value(str(value), str(key))
        text = ",".join(f"{k}={v}" for k, v in selector.items())
    else:
        text = ",".join(_split(selector)) if selector.strip() else ""
    if not text:
        raise ValueError("the selector is empty: it would select every pod of the namespace")
    if not isinstance(selector, Mapping):
        for req in _split(text):
            if not req:
                raise ValueError(f"{selector!r} has an empty requirement")
            _check_requirement(req)
    return text


def port_name_ok(name: str) -> bool:
    """A container port name (IANA service name): 1-15 of a-z, 0-9 and single inner dashes, a letter."""
    return bool(_PORT_NAME.match(name))
