"""Chat bodies vLLM 0.33 takes, taken the same way by the gateway, in process against scripted
workers: content parts without a `type` (a string part, a part naming its media) are served and
forwarded as sent; an empty model name is the only model's, or a 400 naming the served ones."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.bodies import MODELS_NAMED
from policies import make_policy
from tests.gateway.routes_rig import KEY, SECRET, Rig, config, routes_rig
from tests.gateway.routes_worker import RoutesWorker, start
from tests.support.inprocess import gateway_in_process

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


async def test_an_empty_model_name_goes_to_the_only_model(rig: Rig) -> None:
    """vLLM serves its own model for `"model": ""`; so does a gateway that serves one model, on
    every route (Messages too, where the field itself is required), forwarding the body as sent."""
    chat = {"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    resp = await rig.client.post("/v1/chat/completions", json=chat, headers=KEY)
    assert resp.status_code == 200, resp.text
    completion = {"model": "", "prompt": "hi", "max_tokens": 2}
    assert (await rig.client.post("/v1/completions", json=completion, headers=KEY)).status_code == 200
    resp = await rig.client.post("/v1/messages", json=chat, headers=KEY)
    assert resp.status_code == 200, resp.text
    assert [sent["model"] for sent in _sent(rig)] == ["", "", ""]
    # Absent is still refused where vLLM requires the field (Anthropic's error shape: no param).
    resp = await rig.client.post(
        "/v1/messages", json={k: v for k, v in chat.items() if k != "model"}, headers=KEY
    )
    assert resp.status_code == 400 and "'model' is required" in resp.json()["error"]["message"]
    for model in (None, 7, ["m"]):
        resp = await rig.client.post("/v1/messages", json={**chat, "model": model}, headers=KEY)
        assert resp.status_code == 400 and "'model' is required" in resp.json()["error"]["message"]
    assert len(_sent(rig)) == 3


@pytest.mark.parametrize("n_models", [2, MODELS_NAMED + 3])
async def test_an_empty_model_name_among_several_is_a_400_naming_them(n_models: int) -> None:
    worker = RoutesWorker("w")
    runner = await start(worker)
    one = config([worker.url])
    more = [{"name": f"q{i}", "models": [f"m{i}"], "workers": [worker.url]} for i in range(1, n_models)]
    try:
        async with gateway_in_process(
            {**one, "pools": [*one["pools"], *more]}, make_policy("round_robin"), secret=SECRET
        ) as gw:
            for model in ("", None):
                body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
                if model is not None:
                    body["model"] = model
                resp = await gw.client.post("/v1/chat/completions", json=body, headers=KEY)
                assert resp.status_code == 400
                error = resp.json()["error"]
                assert error["param"] == "model" and error["type"] == "invalid_request_error"
                named = ["m", *(f"m{i}" for i in range(1, n_models))][:MODELS_NAMED]
                assert f"serves {n_models} models: " + ", ".join(f"'{m}'" for m in named) in error["message"]
                if n_models > MODELS_NAMED:
                    assert f"and {n_models - MODELS_NAMED} more" in error["message"]
                    assert f"'m{MODELS_NAMED}'" not in error["message"]
        assert worker.received == []
    finally:
        await runner.cleanup()
