"""Volatile rules: take declared-volatile text out of its place (move to the end, drop) or warn."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import orjson

from prompt_normalizer.config import VolatileRule
from prompt_normalizer.linear_regex import LinearPattern
from prompt_normalizer.switches import Report


def text_slots(msg: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(path suffix, container, key) of every text string in a message's content."""
    content = msg.get("content")
    if isinstance(content, str):
        return [("content", msg, "content")]
    if isinstance(content, list):
        return [
            (f"content[{j}].text", part, "text")
            for j, part in enumerate(content)
            if part.get("type") == "text" and isinstance(part.get("text"), str)
        ]
    return []


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> LinearPattern:
    return LinearPattern(pattern)  # valid: the rule's validator compiled it already


def apply_rules(
    rules: Sequence[VolatileRule], messages: list[dict[str, Any]], moved: list[str], report: Report
) -> None:
    """Apply the rules in order (each sees what the earlier ones left)."""
    for rule in rules:
        apply_rule(rule, messages, moved, report)


def apply_rule(rule: VolatileRule, messages: list[dict[str, Any]], moved: list[str], report: Report) -> None:
    last_user = len(messages)
    if rule.scope == "before_last_user":
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages))
    for i, msg in enumerate(messages):
        if msg["role"] not in rule.roles or (rule.scope == "before_last_user" and i >= last_user):
            continue
        if rule.field is not None:
            if rule.field not in msg or msg[rule.field] in (None, ""):
                continue
            path = f"messages[{i}].{rule.field}"
            if rule.action == "keep_and_warn":
                report.add(f"volatile {rule.name!r} kept in place (prefix may break): {path}", changed=False)
                continue
            value = msg.pop(rule.field)
            if rule.action == "move_to_end":
                moved.append(value if isinstance(value, str) else orjson.dumps(value).decode())
            report.add(f"volatile {rule.name!r} {rule.action}: {path}")
            continue
        assert rule.pattern is not None
        regex = _compiled(rule.pattern)
        for suffix, container, key in text_slots(msg):
            cut = regex.cut(container[key])
            if cut is None:
                continue
            found, rest = cut
            path = f"messages[{i}].{suffix}"
            if rule.action == "keep_and_warn":
                report.add(
                    f"volatile {rule.name!r} kept in place (prefix may break): "
                    f"{path}, {len(found)} match(es)",
                    changed=False,
                )
                continue
            container[key] = rest
            if rule.action == "move_to_end":
                moved.extend(found)
            report.add(f"volatile {rule.name!r} {rule.action}: {path}, {len(found)} match(es)")
