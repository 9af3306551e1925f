"""Deterministic log-probabilities of generated tokens, and their OpenAI shapes.

The emulator samples nothing, so each output token is its own most likely token; its logprob
and the alternatives below it are fixed functions of (seed, position, token id). The same
request therefore always reports the same numbers, and the top entry is always the chosen token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.emulator.output import Answer
from loadtest.engine.tokenizer import Tokenizer

_MASK64 = (1 << 64) - 1
_ALT_STRIDE = 7919  # a prime, so alternatives of one token are distinct ids


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token: its text, logprob, the top entries (the token itself first), and where
    it starts in the answer text (characters)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    text_offset: int


def _mix(seed: int, *values: int) -> int:
    x = seed & _MASK64
    for v in values:
        x = ((x ^ (v & _MASK64)) * 0x9E3779B97F4A7C15) & _MASK64
        x ^= x >> 29
    return x


class LogprobWriter:
    """Computes the logprobs of an answer's tokens; `top_k` entries per token (at least one)."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self._tok = tokenizer
        self._seed = seed

    def _text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def for_answer(self, answer: Answer, top_k: int) -> tuple[TokenLogprob, ...]:
        ids = answer.token_ids
        vocab = self._tok.vocab_size
        out: list[TokenLogprob] = []
        offset = 0
        for pos, piece in enumerate(answer.pieces):
            tid = int(ids[pos]) if pos < len(ids) else 0
            lp = -(_mix(self._seed, tid, pos) % 4096) / 4096 * 1.5  # in (-1.5, 0]
            top = [(piece, lp)]
            for j in range(1, top_k):
                alt = (tid + j * _ALT_STRIDE) % vocab
                gap = 0.75 * j + (_mix(self._seed, tid, pos, j) % 256) / 1024
                top.append((self._text(alt), lp - gap))
            out.append(TokenLogprob(piece, lp, tuple(top), offset))
            offset += len(piece)
        return tuple(out)


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob], top_k: int) -> dict[str, Any]:
    """Chat's `choices[].logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    return {
        "content": [
            {**_entry(e.token, e.logprob), "top_logprobs": [_entry(t, lp) for t, lp in e.top[:top_k]]}
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Completions' `choices[].logprobs`: parallel lists; offsets count characters of the text."""
    return {
        "text_offset": [e.text_offset for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [e.token for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
    }


def responses_delta_logprobs(entries: Sequence[TokenLogprob], top_k: int) -> list[dict[str, Any]]:
    """A Responses `output_text.delta` event's `logprobs`: as chat's entries, without `bytes`."""
    return [
        {"token": e.token, "logprob": e.logprob,
         "top_logprobs": [{"token": t, "logprob": lp} for t, lp in e.top[:top_k]]}
        for e in entries
    ]  # fmt: skip
