"""Stop strings on a deterministic answer, applied as vLLM's detokenizer applies them.

The emulator decides its whole answer up front, so a stop string is meaningful exactly when it
occurs in the text the answer would have had: the answer then ends at the token that completed
it. Per token, as in vLLM (`vllm/v1/engine/detokenizer.py`):

- once more than `min_tokens` tokens are out, look for each stop string (in list order) where it
  could end inside the new token's text; the first found stops the sequence at this token;
- the text is cut before the stop string (after it with `include_stop_str_in_output`);
- while streaming without `include_stop_str_in_output`, the last `len(longest stop) - 1`
  characters are held back (they may begin a stop string), and the final token flushes the rest;
  so a held-back token streams an empty delta, and the deltas always add up to the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.emulator.output import Answer


@dataclass(frozen=True, slots=True)
class StopRule:
    """A request's stop strings (non-empty), whether a matched one stays in the text, and how
    many output tokens come before any stop is looked for (`min_tokens`)."""

    strings: tuple[str, ...]
    include_in_output: bool = False
    min_tokens: int = 0


def _match(text: str, new_chars: int, strings: tuple[str, ...]) -> tuple[str, int] | None:
    """The first stop string (list order) that ends within the last `new_chars` characters of
    `text`, and where it starts."""
    for stop in strings:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1:
            return stop, start
    return None


def cut_at_stop(answer: Answer, rule: StopRule | None) -> Answer:
    """`answer` ended at its first stop string under `rule` (unchanged without one, except that
    its streamed deltas hold back what could begin a stop string)."""
    if rule is None or not rule.strings:
        return answer
    hold = 0 if rule.include_in_output else max(len(s) for s in rule.strings) - 1
    text = ""
    sent = 0
    deltas: list[str] = []
    for i, piece in enumerate(answer.pieces):
        text += piece
        found = _match(text, len(piece), rule.strings) if piece and i + 1 > rule.min_tokens else None
        if found is not None:
            stop, start = found
            text = text[: start + len(stop)] if rule.include_in_output else text[:start]
            deltas.append(text[sent:])
            n = i + 1
            return Answer(answer.token_ids[:n], answer.pieces[:n], text, tuple(deltas), stop)
        last = i == len(answer.pieces) - 1
        end = len(text) if last else max(sent, len(text) - hold)
        deltas.append(text[sent:end])
        sent = end
    return Answer(answer.token_ids, answer.pieces, text, tuple(deltas))
