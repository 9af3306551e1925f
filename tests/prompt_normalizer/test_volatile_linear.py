"""Client text and operator patterns are handled in time linear in the text."""

from __future__ import annotations

import pytest

from prompt_normalizer.switches import normalize_whitespace


@pytest.mark.timeout(10)
def test_whitespace_normalization_is_linear_in_the_text() -> None:
    # Trailing blanks were found with a regex that tried every run of blanks against a newline
    # that never came: quadratic in a run of spaces (30,000 took 5.7 s).
    spaces = " " * 200_000
    assert normalize_whitespace(f"a{spaces}b") == f"a{spaces}b"
    assert normalize_whitespace(" a \t\r\nb  \n\n c\t ") == "a\nb\n\n c"
