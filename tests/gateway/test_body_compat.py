"""Chat bodies vLLM 0.33 takes, taken the same way by the gateway, in process against scripted
workers: content parts without a `type` (a string part, a part naming its media) are served and
forwarded as sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.gateway.routes_rig import KEY, Rig, routes_rig

IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="  # noqa: E501


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig() as rig:
        yield rig


def _sent(rig: Rig) -> list[Any]:
    return [got.json() for worker in rig.workers for got in worker.received]


@pytest.mark.parametrize(
    "content",
    [
        ["hi", "there"],
        [{"image_url": IMAGE}, "what is this?"],
        [
            {"audio_url": "https://example.invalid/a.wav"},
            {"video_url": {"url": "https://example.invalid/v.mp4"}},
        ],
    ],
    ids=["strings", "image_url", "audio_video"],
)
async def test_parts_without_a_type_are_served_as_sent(rig: Rig, content: list[Any]) -> None:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    resp = await rig.client.post("/v1/chat/completions", json=body, headers=KEY)
    assert resp.status_code == 200, resp.text
    (sent,) = _sent(rig)
    assert sent["messages"] == body["messages"]


async def test_a_part_without_a_type_or_media_is_a_400_naming_it(rig: Rig) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": ["hi", {"text": "no type"}]}]}
    resp = await rig.client.post("/v1/chat/completions", json=body, headers=KEY)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages[0].content[1]"
    assert _sent(rig) == []
