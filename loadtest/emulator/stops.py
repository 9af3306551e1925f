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

import bisect
import itertools
from dataclasses import dataclass

from loadtest.emulator.output import Answer


@dataclass(frozen=True, slots=True)
class StopRule:
    """A request's stop strings (non-empty), whether a matched one stays in the text, and how
    many output tokens come before any stop is looked for (`min_tokens`)."""

    strings: tuple[str, ...]
    include_in_output: bool = False
    min_tokens: int = 0


def _first_stop(pieces: tuple[str, ...], text: str, rule: StopRule) -> tuple[int, str, int] | None:
    """The stop that ends the answer as the per-token check finds it: (its token's index, the
    string, where it starts), the earliest token and within it the first string in list order;
    None when none ends past the first `min_tokens` tokens. One search per string over the whole
    text (a per-token search costs tokens × strings, which a long stop list makes minutes)."""
    ends = list(itertools.accumulate(len(piece) for piece in pieces))
    if rule.min_tokens > len(ends):
        return None
    floor = ends[rule.min_tokens - 1] if rule.min_tokens else 0  # characters out before any check
    best: tuple[tuple[int, int], str, int] | None = None
    for order, stop in enumerate(rule.strings):
        start = text.find(stop, max(0, floor - len(stop) + 1))
        if start == -1:
            continue
        token = bisect.bisect_left(ends, start + len(stop))  # the token whose text completes it
        if best is None or (token, order) < best[0]:
            best = ((token, order), stop, start)
    return None if best is None else (best[0][0], best[1], best[2])


def cut_at_stop(answer: Answer, rule: StopRule | None) -> Answer:
    """`answer` ended at its first stop string under `rule` (unchanged without one, except that
    its streamed deltas hold back what could begin a stop string)."""
    if rule is None or not rule.strings:
        return answer
    pieces, text = answer.pieces, "".join(answer.pieces)
    found = _first_stop(pieces, text, rule)
    n = len(pieces) if found is None else found[0] + 1
    if found is None:
        final = len(text)
    else:
        _, stop, start = found
        final = start + len(stop) if rule.include_in_output else start
    hold = 0 if rule.include_in_output else max(len(s) for s in rule.strings) - 1
    deltas: list[str] = []
    sent = out = 0
    for i in range(n):
        out += len(pieces[i])
        end = final if i == n - 1 else max(sent, out - hold)
        deltas.append(text[sent:end])
        sent = end
    if found is None:
        return Answer(answer.token_ids, pieces, text, tuple(deltas))
    return Answer(answer.token_ids[:n], pieces[:n], text[:final], tuple(deltas), found[1])
