"""vLLM's routes beyond the OpenAI API through a real gateway in front of a real emulated vLLM
worker: render, SageMaker (`/ping`, `/invocations`), SGLang's tokenizer names, `model` left out
of chat and completions, and the model cards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import gateway_over_one_emulator

KEY = "sk-engine-routes"
MODEL = "emu-engine"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 3}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_over_one_emulator(Path(tmp_path_factory.mktemp("engine-routes")), MODEL, KEY) as base:
        yield base


def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=AUTH, timeout=30)


def test_render_routes_answer_the_workers_token_ids(gateway: str) -> None:
    chat = post(gateway, "/v1/chat/completions/render", {"model": MODEL, **CHAT})
    assert chat.status_code == 200, chat.text
    assert chat.json()["token_ids"] and chat.json()["model"] == MODEL
    completions = post(gateway, "/v1/completions/render", {"model": MODEL, "prompt": "Once upon a time"})
    assert completions.status_code == 200, completions.text
    assert completions.json()[0]["token_ids"]


def test_invocations_answer_as_the_route_the_body_names(gateway: str) -> None:
    chat = post(gateway, "/invocations", {"model": MODEL, **CHAT})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = post(gateway, "/invocations", {"model": MODEL, "prompt": "Once", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    # Neither chat nor completions: the worker's own /invocations places it (an embedding here).
    embedding = post(gateway, "/invocations", {"model": MODEL, "input": "a cat sat"})
    assert embedding.status_code == 200 and embedding.json()["data"][0]["object"] == "embedding"


def test_chat_and_completions_without_model_take_the_only_one(gateway: str) -> None:
    chat = post(gateway, "/v1/chat/completions", CHAT)
    assert chat.status_code == 200 and chat.json()["model"] == MODEL
    completion = post(gateway, "/v1/completions", {"prompt": "Once", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["model"] == MODEL


def test_sglang_tokenizer_names(gateway: str) -> None:
    tokens = post(gateway, "/v1/tokenize", {"model": MODEL, "prompt": "hello there"})
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    text = post(gateway, "/v1/detokenize", {"model": MODEL, "tokens": tokens.json()["tokens"]})
    assert text.status_code == 200 and text.json()["prompt"]


def test_ping_and_cards(gateway: str) -> None:
    assert httpx.get(gateway + "/ping", timeout=5).json() == {"status": "ok"}
    assert httpx.post(gateway + "/ping", timeout=5).status_code == 200
    assert httpx.get(gateway + "/health_generate", timeout=5).status_code == 200
    card = httpx.get(f"{gateway}/v1/models/{MODEL}", headers=AUTH, timeout=5).json()
    assert card["root"] == MODEL and card["parent"] is None and card["permission"] == []
    assert card["owned_by"] == "kvgate"
