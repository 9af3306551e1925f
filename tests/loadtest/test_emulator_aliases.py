"""The emulated worker's other names for its routes: SageMaker's `/invocations` dispatching by
body shape as vLLM does, SGLang's `/v1/tokenize` and `/v1/detokenize` (a real process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.processes import running_emulator

pytestmark = pytest.mark.e2e

MODEL = "emu-aliases"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_emulator("--model", MODEL, "--time-scale", "20") as base:
        yield base


def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=10)


def test_invocations_dispatch_by_body_shape(base_url: str) -> None:
    chat = post(base_url, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = post(base_url, "/invocations", {"prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    embedding = post(base_url, "/invocations", {"input": ["a", "b"]})
    assert embedding.status_code == 200 and len(embedding.json()["data"]) == 2
    refused = post(base_url, "/invocations", {"query": "a"})
    assert refused.status_code == 400


def test_sglang_tokenizer_paths_answer_as_vllms(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "hello world"}
    assert post(base_url, "/v1/tokenize", body).json() == post(base_url, "/tokenize", body).json()
    tokens = post(base_url, "/v1/tokenize", body).json()["tokens"]
    assert (
        post(base_url, "/v1/detokenize", {"tokens": tokens}).json()
        == post(base_url, "/detokenize", {"tokens": tokens}).json()
    )
