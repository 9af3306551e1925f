"""Operator-written regular expressions (volatile rules), run by RE2 in time linear in the text.

Python's `re` backtracks: a pattern such as `Session: (\\w+\\s?)+;` tries every way to split a
word between its groups, so a 34-character message took 1.4 s (4x more per 2 more characters),
on the event loop. RE2 (google-re2) never backtracks. What it cannot run in linear time,
backreferences and look-around, it refuses when the policy is loaded; the refusal names the
construct. Its syntax is otherwise Python's, except that `\\w`, `\\d`, `\\s` and `\\b` are ASCII
(`\\pL`, `\\pN`, `[\\p{L}\\p{N}_]` match any script) and the end of text is `\\z`, not `\\Z`.

Matching runs on the UTF-8 bytes of the text: google-re2 maps every match of a `str` back to
character offsets in Python, which made a match cost ~35 µs on a 1.2 KB system prompt against
~3 µs for `re`; on bytes it costs about what `re` does (docs/normalizer.md, "Volatile rules").
"""

from __future__ import annotations

import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # refusals are reported by the caller, not printed by RE2


class LinearPattern:
    """One compiled pattern. Raises `ValueError`, explaining what RE2 refused, when it cannot be
    compiled."""

    __slots__ = ("_regex", "pattern")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        try:
            self._regex = re2.compile(pattern, _OPTIONS)
        except re2.error as exc:
            raise ValueError(_explain(pattern, exc)) from None

    def matches_empty(self) -> bool:
        """Whether the pattern matches the empty string."""
        return self._regex.fullmatch(b"") is not None

    def cut(self, text: str) -> tuple[list[str], str] | None:
        """The matches in `text`, in order, and `text` without them; None when nothing matches."""
        data = text.encode("utf-8", "surrogatepass")
        spans = [m.span() for m in self._regex.finditer(data)]
        if not spans:
            return None
        found = [data[start:end].decode("utf-8", "surrogatepass") for start, end in spans]
        kept = []
        pos = 0
        for start, end in spans:
            kept.append(data[pos:start])
            pos = end
        kept.append(data[pos:])
        return found, b"".join(kept).decode("utf-8", "surrogatepass")


def _explain(pattern: str, exc: Exception) -> str:
    detail = exc.args[0] if exc.args else ""
    reason = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
    backreference = reason.startswith("invalid escape sequence: \\") and reason[-1:].isdigit()
    if backreference or ("(?P" in reason and "(?P=" in pattern):
        why = "RE2 has no backreferences (they cannot be matched in linear time)"
    elif any(op in reason for op in ("(?=", "(?!", "(?<=", "(?<!")):
        why = "RE2 has no look-around (it cannot be matched in linear time)"
    elif reason.endswith("\\Z"):
        why = "RE2 writes the end of text as \\z"
    else:
        why = "RE2 cannot compile it"
    return f"pattern refused: {why} ({reason})"
