"""Client text is handled in time linear in its length: volatile-rule patterns run by RE2
whatever an operator writes (a pattern RE2 cannot run that way is refused when the policy is
loaded), and whitespace normalization without a backtracking regex."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prompt_normalizer.config import VolatileRule
from prompt_normalizer.switches import Report, normalize_whitespace
from prompt_normalizer.volatile import apply_rule

# `re` backtracks through every split of the word between the groups: 34 characters took 1.4 s,
# and each 2 more characters 4 times longer.
BACKTRACKING = r"Session: (\w+\s?)+;"


def _run(rule: VolatileRule, text: str) -> tuple[str, list[str]]:
    messages = [{"role": "system", "content": text}]
    moved: list[str] = []
    apply_rule(rule, messages, moved, Report())
    content = messages[0]["content"]
    assert isinstance(content, str)
    return content, moved


@pytest.mark.timeout(10)
def test_a_backtracking_pattern_does_not_stall_on_a_hostile_message() -> None:
    rule = VolatileRule(name="session", pattern=BACKTRACKING)
    hostile = "Session: " + "a" * 5_000 + "!"  # would take longer than the universe has existed
    assert _run(rule, hostile) == (hostile, [])
    assert _run(rule, "x Session: ab cd; y") == ("x  y", ["Session: ab cd;"])


def test_matches_are_moved_by_character_not_byte() -> None:
    rule = VolatileRule(name="clock", pattern=r"Zeit: [^\n]*")
    text, moved = _run(rule, "Grüße — Zeit: 10:00 Uhr ☕\nweiter, Zeit: 11:00")
    assert text == "Grüße — \nweiter, "
    assert moved == ["Zeit: 10:00 Uhr ☕", "Zeit: 11:00"]


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [
        (r"(a)\1", "backreference"),
        (r"a(?=b)", "look-around"),
        (r"(?<!x)a", "look-around"),
    ],
)
def test_patterns_re2_cannot_run_in_linear_time_are_refused_at_load(pattern: str, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        VolatileRule(name="x", pattern=pattern)
    assert needle in str(info.value) and "RE2" in str(info.value)


@pytest.mark.timeout(10)
def test_whitespace_normalization_is_linear_in_the_text() -> None:
    # Trailing blanks were found with a regex that tried every run of blanks against a newline
    # that never came: quadratic in a run of spaces (30,000 took 5.7 s).
    spaces = " " * 200_000
    assert normalize_whitespace(f"a{spaces}b") == f"a{spaces}b"
    assert normalize_whitespace(" a \t\r\nb  \n\n c\t ") == "a\nb\n\n c"
