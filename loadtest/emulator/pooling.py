"""Deterministic pooling outputs: embeddings, class probabilities and relevance scores.

An embedding is a hashed bag of token bigrams projected through a fixed random table (seeded),
then L2-normalised: the same input always gives the same vector, and texts that share tokens
point in similar directions, so scores and reranking order documents sensibly. No engine time is
spent: pooling models in vLLM do no decoding, and the emulator keeps these routes cheap.
"""

from __future__ import annotations

import base64
import sys
from dataclasses import dataclass, field

import numpy as np

EMBEDDING_DIM = 1024
_TABLE_ROWS = 1024
CLASS_LABELS = ("LABEL_0", "LABEL_1")
EMBED_DTYPES = ("float32", "float16", "bfloat16")
ENDIANNESS = ("native", "little", "big")


@dataclass
class Pooler:
    """Projection tables built on first use from the seed (4 MiB for the embedding table)."""

    seed: int
    _table: np.ndarray | None = field(default=None, repr=False)
    _classes: np.ndarray | None = field(default=None, repr=False)

    def _projection(self) -> np.ndarray:
        if self._table is None:
            rng = np.random.default_rng(self.seed)
            self._table = rng.standard_normal((_TABLE_ROWS, EMBEDDING_DIM)).astype(np.float32)
        return self._table

    def embed(self, token_ids: np.ndarray, dimensions: int = EMBEDDING_DIM) -> np.ndarray:
        """A unit vector of `dimensions` floats (the first dimensions, renormalised)."""
        ids = np.asarray(token_ids, dtype=np.uint64)
        prev = np.concatenate([np.array([np.uint64(0xFFFF)]), ids[:-1]])
        with np.errstate(over="ignore"):  # the bigram hash wraps around on purpose
            keys = (prev * np.uint64(1_000_003) + ids) * np.uint64(2_654_435_761)
        rows = (keys >> np.uint64(16)) % np.uint64(_TABLE_ROWS)
        counts = np.bincount(rows.astype(np.int64), minlength=_TABLE_ROWS).astype(np.float32)
        vec: np.ndarray = (counts @ self._projection())[:dimensions]
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    def classify(self, token_ids: np.ndarray) -> np.ndarray:
        """Softmax probabilities over `CLASS_LABELS`."""
        if self._classes is None:
            rng = np.random.default_rng(self.seed + 1)
            self._classes = rng.standard_normal((len(CLASS_LABELS), EMBEDDING_DIM)).astype(np.float32)
        logits = self._classes @ self.embed(token_ids)
        exp = np.exp(logits - logits.max())
        probs: np.ndarray = exp / exp.sum()
        return probs

    def score(self, a: np.ndarray, b: np.ndarray) -> float:
        """Relevance in [0, 1]: the cosine similarity of the two embeddings, moved to [0, 1]."""
        return (float(self.embed(a) @ self.embed(b)) + 1.0) / 2.0


def encode_vector(vec: np.ndarray, encoding_format: str, embed_dtype: str = "float32") -> list[float] | str:
    """`float`: a list of floats; `base64`: the little-endian bytes of `embed_dtype` values
    (float32 is what the OpenAI SDK decodes by default)."""
    if encoding_format == "float":
        out: list[float] = vec.astype(np.float64).tolist()
        return out
    return base64.b64encode(vector_bytes(vec, embed_dtype)).decode()


def vector_bytes(vec: np.ndarray, embed_dtype: str = "float32", endianness: str = "little") -> bytes:
    """The raw `embed_dtype` values of `vec` in `endianness` byte order ("native" is this
    machine's); bfloat16 is the upper half of each float32."""
    order = "<" if endianness == "little" or (endianness == "native" and sys.byteorder == "little") else ">"
    if embed_dtype == "float16":
        return vec.astype(order + "f2").tobytes()
    if embed_dtype == "bfloat16":
        return (vec.astype("<f4").view("<u4") >> 16).astype(order + "u2").tobytes()
    return vec.astype(order + "f4").tobytes()
