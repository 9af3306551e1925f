"""Stop strings on the emulator's deterministic answers (`loadtest/emulator/stops.py`), without a
process: where an answer ends, what it keeps, and what each of its tokens streams."""

from __future__ import annotations

from loadtest.emulator.output import Answer, AnswerWriter
from loadtest.emulator.stops import StopRule, cut_at_stop
from loadtest.engine.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
WRITER = AnswerWriter(TOK, 7)


def _answer(text: str) -> Answer:
    return WRITER.fixed_answer(text)


def test_an_answer_ends_at_the_token_that_completes_a_stop_string() -> None:
    full = WRITER.text_answer(TOK.encode("a prompt"), 60)
    stop = full.text[20:24]
    at = full.text.find(stop)
    cut = cut_at_stop(full, StopRule((stop,)))
    assert cut.text == full.text[:at] and cut.stop_reason == stop
    assert len(cut.pieces) == at + len(stop) and cut.pieces == full.pieces[: at + len(stop)]
    assert cut.token_ids.tolist() == full.token_ids[: at + len(stop)].tolist()
    assert "".join(cut.deltas) == cut.text and len(cut.deltas) == len(cut.pieces)
    kept = cut_at_stop(full, StopRule((stop,), include_in_output=True))
    assert kept.text == full.text[: at + len(stop)] and kept.deltas == kept.pieces
    assert kept.stop_reason == stop


def test_a_stream_holds_back_what_could_begin_a_stop_string() -> None:
    cut = cut_at_stop(_answer("abcdefXYZghi"), StopRule(("XYZ", "q")))
    # Two characters (the longest stop string less one) wait until the answer ends.
    assert cut.text == "abcdef" and cut.stop_reason == "XYZ"
    assert cut.deltas == ("", "", "a", "b", "c", "d", "e", "f", "")
    never = cut_at_stop(_answer("abcdef"), StopRule(("XYZ",)))
    assert never.text == "abcdef" and never.stop_reason is None and len(never.pieces) == 6
    assert never.deltas == ("", "", "a", "b", "c", "def")


def test_min_tokens_hides_stop_strings_that_end_within_them() -> None:
    answer = _answer("ab ab ab")
    assert cut_at_stop(answer, StopRule(("ab",), min_tokens=2)).text == "ab "
    assert cut_at_stop(answer, StopRule(("ab",), min_tokens=1)).text == ""  # ends at token 2
    assert cut_at_stop(answer, StopRule(("ab",), min_tokens=7)).text == "ab ab "


def test_stop_strings_that_complete_together_go_by_list_order() -> None:
    answer = _answer("xxab yy")
    assert cut_at_stop(answer, StopRule(("b", "ab"))).text == "xxa"
    assert cut_at_stop(answer, StopRule(("ab", "b"))).text == "xx"
    assert cut_at_stop(answer, StopRule(("xx",))).text == ""


def test_no_rule_leaves_the_answer_alone() -> None:
    answer = _answer("hello")
    assert cut_at_stop(answer, None) is answer
    assert answer.deltas == answer.pieces and answer.text == "hello" and answer.stop_reason is None
