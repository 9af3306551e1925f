"""Deterministic answers: the same prompt and seed always produce the same output tokens."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np

from loadtest.engine.tokenizer import Tokenizer

_TEXT = (
    "the cache keeps every prefix it has seen until memory runs short and then drops the oldest "
    "blocks first while the scheduler batches decode steps with chunks of new prompts so that "
    "routing requests with shared history to the same worker saves prefill time and lowers the "
    "time to first token for agents tools documents and long conversations across many users"
)
_WORDS = tuple(_TEXT.split())
_BASE_WORDS = 4096


def _base_text(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(_BASE_WORDS)) + " "


@dataclass(frozen=True, slots=True)
class Answer:
    """Output token ids, the text piece of each token, the answer's text, and what a stream
    sends with each token (`deltas`, adding up to `text`). Without a stop string the text is the
    pieces joined and each token streams its piece; `stops.cut_at_stop` makes the others, and
    `stop_reason` names the stop string that ended the answer."""

    token_ids: np.ndarray
    pieces: tuple[str, ...]
    text: str
    deltas: tuple[str, ...]
    stop_reason: str | None = None


class AnswerWriter:
    """Cuts answers out of a fixed seeded text at an offset chosen by the prompt's digest."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self._tok = tokenizer
        self._text = _base_text(seed)
        self._seed = seed

    def _slice(self, prompt_ids: np.ndarray, n_chars: int, variant: int) -> str:
        digest = hashlib.blake2b(np.ascontiguousarray(prompt_ids, dtype="<i8").tobytes(), digest_size=8)
        digest.update(self._seed.to_bytes(8, "big", signed=True))
        if variant:  # choice 0 keeps the answer a request with n=1 gets
            digest.update(variant.to_bytes(8, "big"))
        base = self._text
        start = int.from_bytes(digest.digest(), "big") % len(base)
        start = base.find(" ", start) + 1  # begin at a word
        out = base[start : start + n_chars]
        while len(out) < n_chars:
            out += base[: n_chars - len(out)]
        return out

    def text_answer(self, prompt_ids: np.ndarray, max_tokens: int, variant: int = 0) -> Answer:
        """Exactly `max_tokens` tokens of text (the emulator always runs to max_tokens);
        `variant` (the choice index when n > 1) picks another answer to the same prompt."""
        n_chars = max_tokens
        for _ in range(6):
            text = self._slice(prompt_ids, n_chars, variant)
            pieces = self._tok.pieces(text)
            if len(pieces) >= max_tokens:
                pieces = pieces[:max_tokens]
                return self.fixed_answer("".join(pieces))
            n_chars *= 2
        raise RuntimeError("tokenizer produced too few tokens for an answer")

    def fixed_answer(self, text: str) -> Answer:
        """Tokens of a given text (e.g. tool-call arguments)."""
        pieces = tuple(self._tok.pieces(text)) or (" ",)
        joined = "".join(pieces)
        return Answer(self._tok.encode(joined), pieces, joined, pieces)
