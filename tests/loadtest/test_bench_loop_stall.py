"""The loop-stall benchmark's bodies: each shape is a chat body the gateway reads whole (under its
8 MiB body limit) and keys in its keying process (over the inline size)."""

from __future__ import annotations

import pytest

from gateway.bodies import parse_body
from gateway.config import LimitsConfig
from gateway.keying import INLINE_PROMPT_BYTES
from gateway.routes import ROUTES
from loadtest.bench_loop_stall import SHAPES, body_of


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_is_a_large_chat_body_under_the_body_limit(shape: str) -> None:
    raw = body_of(shape)
    assert INLINE_PROMPT_BYTES < len(raw) <= LimitsConfig().max_body_bytes
    assert parse_body(raw, ROUTES["/v1/chat/completions"])["messages"]
