"""Tokenizers for the emulated worker and for workloads that must hit exact token counts.

`ByteTokenizer` (default): one token per UTF-8 byte, ids 0..255, so 512 ASCII characters are
exactly 512 tokens. `HFTokenizer`: any Hugging Face `tokenizer.json`, loaded from a local file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from prompt_normalizer.extras import TOKENIZER_EXTRA


class TokenizerError(ValueError):
    """Token ids outside the vocabulary, or a tokenizer file that cannot be loaded."""


class Tokenizer(Protocol):
    """What the emulator needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64 array) of `text`, without special tokens."""
        ...

    def decode(self, token_ids: np.ndarray | list[int]) -> str: ...

    def pieces(self, text: str) -> list[str]:
        """Split `text` into one string per token, such that `"".join(pieces) == text`."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, token_ids: np.ndarray | list[int]) -> str:
        arr = np.asarray(token_ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise TokenizerError("token ids must be in 0..255 for the byte tokenizer")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def pieces(self, text: str) -> list[str]:
        if text.isascii():
            return list(text)
        # A multi-byte character is one piece for its first byte and empty pieces for the rest,
        # so streamed text stays valid UTF-8 while the piece count equals the token count.
        out: list[str] = []
        for ch in text:
            out.append(ch)
            out.extend([""] * (len(ch.encode("utf-8")) - 1))
        return out


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a local tokenizer.json (no download)."""

    def __init__(self, path: str | Path) -> None:
        try:  # imported here: the byte tokenizer, the default, needs no package
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise TokenizerError(
                f"tokenizer {path} needs the tokenizers package: pip install '{TOKENIZER_EXTRA}'"
            ) from None
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise TokenizerError(f"cannot load tokenizer {path}: {exc}") from exc
        self.name = str(path)
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, token_ids: np.ndarray | list[int]) -> str:
        ids = [int(t) for t in token_ids]
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise TokenizerError(f"token ids must be in 0..{self.vocab_size - 1}")
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def pieces(self, text: str) -> list[str]:
        enc = self._tok.encode(text, add_special_tokens=False)
        starts = [int(s) for s, _e in enc.offsets]
        if not starts:
            return []
        starts[0] = 0
        ends = [*starts[1:], len(text)]
        return [text[s:e] for s, e in zip(starts, ends, strict=True)]


def load_tokenizer(path: str | None) -> Tokenizer:
    """The byte tokenizer when `path` is None, else the tokenizer.json at `path`."""
    if path is None:
        return ByteTokenizer()
    return HFTokenizer(path)
