"""The normalizer facade the gateway and the simulator call.

This first cut implements only the `approximate` mode with no zones beyond one append-only span:
canonical text (sorted-key JSON of the request's messages) cut into fixed character chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import orjson
import xxhash
from pydantic import BaseModel, ConfigDict

from prompt_normalizer.types import BlockKey, CanonicalPrompt, KeyIdentity, Zone, ZoneSpan

Endpoint = Literal["chat", "completions"]


class NormalizerConfig(BaseModel):
    """Per-pool normalizer settings (part of the policy YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["approximate", "tokenizer", "render"] = "approximate"
    chars_per_token: int = 4


class Normalizer:
    """Turns one OpenAI request body into a `CanonicalPrompt` under a `KeyIdentity`."""

    def __init__(self, config: NormalizerConfig, secret: bytes) -> None:
        self._config = config
        self._seed = xxhash.xxh3_64_intdigest(secret)

    def canonicalize(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        identity: KeyIdentity,
        public_identity: KeyIdentity | None = None,
    ) -> CanonicalPrompt:
        source = "messages" if endpoint == "chat" else "prompt"
        text = orjson.dumps(body.get(source), option=orjson.OPT_SORT_KEYS)
        n_tokens = max(1, len(text) // self._config.chars_per_token)
        chunk = identity.block_size_tokens * self._config.chars_per_token
        root = xxhash.xxh3_64_intdigest(repr(identity).encode(), seed=self._seed)
        keys: list[BlockKey] = []
        prev = root
        for start in range(0, len(text) - chunk + 1, chunk):
            prev = xxhash.xxh3_64_intdigest(text[start : start + chunk], seed=prev)
            keys.append(BlockKey(prev))
        return CanonicalPrompt(
            n_tokens=n_tokens,
            block_size_tokens=identity.block_size_tokens,
            block_keys=tuple(keys),
            zones=(ZoneSpan(Zone.APPEND_ONLY, source, 0, n_tokens),),
        )
