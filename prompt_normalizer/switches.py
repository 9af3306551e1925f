"""The canonicalization switches as pure transforms, and the bounded diagnostics report.

Each transform returns the new value and whether it changed anything, so the caller reports a
switch only when it did something.
"""

from __future__ import annotations

import json
import math
import unicodedata
from decimal import Decimal
from typing import Any

import orjson

from prompt_normalizer.errors import NormalizerError

MAX_DIAGNOSTICS = 32


class Report:
    """Bounded diagnostics: paths and switch names only, never content."""

    __slots__ = ("changed", "dropped", "lines")

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.dropped = 0
        self.changed = False

    def add(self, line: str, *, changed: bool = True) -> None:
        self.changed = self.changed or changed
        if len(self.lines) < MAX_DIAGNOSTICS:
            self.lines.append(line)
        else:
            self.dropped += 1

    def done(self) -> tuple[str, ...]:
        if self.dropped:
            return (*self.lines, f"... {self.dropped} more diagnostics")
        return tuple(self.lines)


def json_copy(value: Any, param: str) -> Any:
    """A private deep copy through JSON (also proves the value is JSON)."""
    try:
        return orjson.loads(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        raise NormalizerError("must be JSON (string keys, finite numbers)", param=param) from None


def nfc(value: Any) -> tuple[Any, bool]:
    """Unicode NFC of every string (keys too); reports whether anything changed."""
    if isinstance(value, str):
        if value.isascii() or unicodedata.is_normalized("NFC", value):
            return value, False
        return unicodedata.normalize("NFC", value), True
    if isinstance(value, list):
        changed = False
        out = []
        for item in value:
            new, c = nfc(item)
            out.append(new)
            changed |= c
        return out, changed
    if isinstance(value, dict):
        changed = False
        result: dict[str, Any] = {}
        for k, v in value.items():
            nk, ck = nfc(k)
            nv, cv = nfc(v)
            result[nk] = nv
            changed |= ck or cv
        return result, changed
    return value, False


# The members of a JSON Schema object whose order reaches the model's answer: constrained decoding
# (a required or named tool, a strict schema) writes an object's properties in the order the
# schema lists them, so a client that lists `reasoning` before `answer` gets its reasoning first.
ORDERED_MEMBERS = frozenset(("properties",))


def sort_keys(value: Any, keep_order: bool = False, *, sort_all: bool = False) -> tuple[Any, bool]:
    """Recursively sorted object keys; reports whether any object was out of order. The members
    of a schema's `properties` (`ORDERED_MEMBERS`) keep their order unless `sort_all`: only what
    is inside each is sorted (`keep_order` is that object's own)."""
    if isinstance(value, dict):
        keys = list(value)
        ordered = keys if keep_order else sorted(keys)
        changed = keys != ordered
        result: dict[str, Any] = {}
        for k in ordered:
            keep = not (keep_order or sort_all) and k in ORDERED_MEMBERS
            result[k], c = sort_keys(value[k], keep, sort_all=sort_all)
            changed |= c
        return result, changed
    if isinstance(value, list):
        changed = False
        out = []
        for item in value:
            new, c = sort_keys(item, sort_all=sort_all)
            out.append(new)
            changed |= c
        return out, changed
    return value, False


# A number literal orjson may not keep: it reads an integer beyond the signed and unsigned 64-bit
# ranges as a float (`98765432109876543210987` would come back as `9.876543210987654e+22`), and any
# other number as the nearest double, which it writes back as that double's shortest text. A
# double holds every literal of at most 15 significant digits within its normal range, so what may
# change is a run of 16 or more digits and points (a longer integer, or a longer mantissa) or a
# negative exponent of three digits or more (`1e-400` reads as 0.0, `2.5e-324` as the subnormal
# `5e-324`; orjson refuses a number too large for a double, and a mantissa of 15 characters with a
# two-digit exponent stays within 1e-113..1e114); anything else is kept exactly whatever it is.
# Found by a byte translation and two substring searches (a tenth of a regex scan's time on a tool
# result full of numbers).
_NUMBER_CLASSES = bytes(
    1 if chr(b) in "0123456789." else 2 if chr(b) in "eE" else 3 if chr(b) == "-" else 0 for b in range(256)
)
_LONG_NUMBER = b"\x01" * 16
_SMALL_EXPONENT = b"\x01\x02\x03\x01\x01\x01"  # `1e-400`
# Every byte that may be part of a number literal kept, every other one a space: split, the text
# gives each literal whole (with words' `e`s, dates and the like from strings, which are no numbers).
_NUMBER_TEXT = bytes(b if chr(b) in "0123456789.eE+-" else 32 for b in range(256))
_INT_RANGE = range(-(2**63), 2**64)


def canonical_json_text(text: str) -> str | None:
    """Compact sorted-key JSON of a string holding a JSON object or array, else None. None too
    when re-encoding would change a number (`_numbers_kept`, `_keeps_numbers`): a canonical form
    never changes a value. (A key given twice is kept once, its last value, as every JSON reader
    that builds objects does: the model reads the same object.)"""
    head = text.lstrip()[:1]
    if head not in ("{", "["):
        return None
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    data = text.encode()
    classes = data.translate(_NUMBER_CLASSES)
    tokens = _long_literals(data) if _LONG_NUMBER in classes else []
    if _SMALL_EXPONENT in classes:
        tokens += _small_exponent_literals(data, classes)
    if tokens and not (_numbers_kept(tokens) or _keeps_numbers(text)):
        return None
    return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode()


def _long_literals(data: bytes) -> list[bytes]:
    """The literals of 16 characters or more of the JSON `data` (and words of strings, such as a
    date's digits and dashes or a hash's digits and `e`s)."""
    return [token for token in data.translate(_NUMBER_TEXT).split() if len(token) > 15]


def _small_exponent_literals(data: bytes, classes: bytes) -> list[bytes]:
    """The literals of the JSON `data` with a negative exponent of three digits or more where
    JSON puts a value (after `[`, `,` or `:`): a UUID's `...5e-123...` in a string is none.
    `classes` is `data` translated by `_NUMBER_CLASSES`."""
    found = []
    at = classes.find(_SMALL_EXPONENT)
    while at >= 0:
        start = at
        while start > 0 and classes[start - 1] == 1:
            start -= 1
        if start > 0 and data[start - 1] == 45:  # a minus sign
            start -= 1
        before = start - 1
        while before >= 0 and data[before] in b" \t\n\r":
            before -= 1
        end = at + 3
        while end < len(data) and classes[end] == 1:
            end += 1
        if before >= 0 and data[before] in b"[,:":
            found.append(data[start:end])
        at = classes.find(_SMALL_EXPONENT, end)
    return found


def _numbers_kept(tokens: list[bytes]) -> bool:
    """Whether orjson keeps the value of every literal of `tokens` (`_long_literals`,
    `_small_exponent_literals`), checked in bulk: orjson reads them all at once and mostly writes
    back the text sent (a float written as its double's shortest text, such as
    `0.30000000000000004`, an integer within 64 bits, such as a snowflake id or a time in
    nanoseconds); only the others are checked one by one (`_literal_kept`). False may also mean
    that a string holds digits that would change as a number: `_keeps_numbers` then tells."""
    sent = b",".join(tokens)
    try:
        written = orjson.dumps(orjson.loads(b"[" + sent + b"]"))[1:-1]
    except orjson.JSONDecodeError:  # a token that is no number: digits and dashes in a string
        return all(_literal_kept(token.decode()) for token in tokens)
    if written == sent:
        return True
    pairs = zip(tokens, written.split(b","), strict=True)
    return all(_literal_kept(token.decode()) for token, out in pairs if token != out)


def _literal_kept(literal: str) -> bool:
    """Whether orjson reads (and writes back) the number `literal` with its exact value: an
    integer within 64 bits, any other number the nearest double of itself (the value of that
    double's shortest text). True for a text that is no number: there is nothing to change."""
    if literal.isdigit() or (literal[:1] == "-" and literal[1:].isdigit()):
        return len(literal) <= 20 and int(literal) in _INT_RANGE  # Python's digit limit, unread
    try:
        value = float(literal)
    except ValueError:
        return True
    shortest = repr(value)
    return shortest == literal or (math.isfinite(value) and Decimal(shortest) == Decimal(literal))


class _NumberChanged(Exception):
    pass


def _checked(literal: str) -> str:
    if not _literal_kept(literal):
        raise _NumberChanged
    return literal


def _keeps_numbers(text: str) -> bool:
    """Whether orjson keeps the value of every number of the JSON `text` (`_literal_kept`), told
    exactly by the standard library's reader, which hands each number literal to `_checked` as
    written: numbers only, never the digits of a string. It runs only on the rare text where
    `_numbers_kept` found a literal that would change."""
    try:
        json.loads(text, parse_float=_checked, parse_int=_checked)
    except (_NumberChanged, ValueError, RecursionError):  # deep nesting
        return False
    return True


def normalize_whitespace(text: str) -> str:
    """CRLF/CR to LF, no trailing blanks on a line, no leading/trailing blank space overall."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Line by line, not with a regex: `[ \t]+(?=\n)` retried every run of blanks against a
    # newline that never came, quadratic in a client's run of spaces.
    return "\n".join(line.rstrip(" \t") for line in text.split("\n")).strip()
