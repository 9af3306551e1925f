"""A chat body with more content parts that are not text than a request may carry
(`prompt_normalizer.chat_input.MAX_MEDIA_PARTS`) is a 400 in OpenAI's shape, naming the limit,
whether it is small or, over 256 KiB, large; it reaches no worker. A realistic multimodal request
within the limit is served. A body of many JSON objects is keyed in the keying process however
small (`gateway.keying.keyed_apart`), and a common one on the loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.keying import INLINE_MAX_OBJECTS, INLINE_PROMPT_BYTES, keyed_apart
from prompt_normalizer.chat_input import MAX_MEDIA_PARTS
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from tests.gateway.request_rig import Rig, request_rig
from tests.gateway.test_keying_process import inline, through_process
from tests.prompt_normalizer.equivalence_corpus import SECRET

HEADERS = {"authorization": "Bearer sk-strict"}


@pytest.fixture
async def rig(tiny_model: Path) -> AsyncIterator[Rig]:
    async with request_rig(tiny_model) as built:
        yield built


def _images(n: int, url_bytes: int = 0) -> list[dict[str, Any]]:
    pad = "A" * url_bytes
    return [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pad}{i:06d}"}} for i in range(n)
    ]


async def _post(rig: Rig, messages: list[dict[str, Any]]) -> tuple[int, Any, int]:
    body = orjson.dumps({"model": "m", "max_tokens": 1, "messages": messages})
    headers = {**HEADERS, "content-type": "application/json"}
    resp = await rig.client.post("/v1/chat/completions", content=body, headers=headers)
    return resp.status_code, resp.json(), len(body)


@pytest.mark.parametrize("url_bytes", [0, 200], ids=["small", "large"])
async def test_too_many_media_parts_is_a_400_naming_the_limit(rig: Rig, url_bytes: int) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You read scanned pages."},
        {"role": "user", "content": [{"type": "text", "text": "pages:"}, *_images(1000, url_bytes)]},
        {"role": "user", "content": _images(1049, url_bytes)},
    ]
    status, answer, size = await _post(rig, messages)
    assert (size > INLINE_PROMPT_BYTES) == (url_bytes > 0)
    assert rig.state.gate.keying.processes.started == 1  # either way: thousands of objects
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "array_above_max_length"
    assert error["param"] == "messages"
    assert "2049 content parts that are not text" in error["message"]
    assert "at most 2048" in error["message"]
    assert rig.upstream.received == []


async def test_a_small_body_of_many_objects_is_keyed_in_the_keying_process(rig: Rig) -> None:
    turns = [
        {"role": "user" if i % 2 else "assistant", "content": f"q{i}"} for i in range(INLINE_MAX_OBJECTS + 1)
    ]
    raw = orjson.dumps({"model": "m", "messages": turns})
    assert len(raw) < INLINE_PROMPT_BYTES // 4 and keyed_apart(raw)
    status, answer, _ = await _post(rig, turns)
    assert status == 200, answer
    assert rig.state.gate.keying.processes.started == 1
    # A common body stays on the loop: as many objects as the limit (the body's own and its
    # messages), or a long text.
    for messages in (turns[: INLINE_MAX_OBJECTS - 1], [{"role": "user", "content": "word " * 50_000}]):
        assert not keyed_apart(orjson.dumps({"model": "m", "messages": messages}))
        status, answer, _ = await _post(rig, messages)
        assert status == 200, answer
    assert rig.state.gate.keying.processes.started == 1
    assert len(rig.upstream.received) == 3


async def test_a_realistic_multimodal_request_is_served(rig: Rig) -> None:
    # 500 images (OpenAI's most a request), each with a caption, over a long conversation.
    turns: list[dict[str, Any]] = []
    for i in range(50):
        parts = [
            p for j, image in enumerate(_images(10)) for p in ({"type": "text", "text": f"{i}.{j}"}, image)
        ]
        turns += [{"role": "user", "content": parts}, {"role": "assistant", "content": "noted"}]
    status, answer, _ = await _post(rig, turns)
    assert status == 200, answer
    assert len(rig.upstream.received) == 1


@pytest.mark.parametrize("n_images", [MAX_MEDIA_PARTS, MAX_MEDIA_PARTS + 1])
async def test_a_large_body_at_the_limit_keys_the_same_in_the_keying_process(n_images: int) -> None:
    """The keying process applies the same limit, and keys a body within it as the loop would."""
    body = {"model": "m", "messages": [{"role": "user", "content": _images(n_images, 200)}]}
    raw = orjson.dumps(body)
    assert len(raw) > INLINE_PROMPT_BYTES
    config = NormalizerConfig()
    path = "/v1/chat/completions"
    expected = inline(raw, path, Normalizer(config, SECRET), 1, True)
    got = await through_process(raw, path, Normalizer(config, SECRET), config, 1, True)
    assert got == expected
    assert ("prompt_error" in expected) == (n_images > MAX_MEDIA_PARTS)
