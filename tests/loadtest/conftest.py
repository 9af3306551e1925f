"""An emulated worker for the modules that talk to one over HTTP: each names its model in
`MODEL` and gets one emulator process for all of its tests (`base_url`), and an OpenAI client
of it (`client`, which a module may define otherwise)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.processes import running_emulator


@pytest.fixture(scope="module")
def base_url(request: pytest.FixtureRequest) -> Iterator[str]:
    model = request.module.MODEL
    with running_emulator("--model", model, "--time-scale", "20", "--kv-blocks", "4000") as base:
        yield base


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key="x", base_url=f"{base_url}/v1", max_retries=0, timeout=20) as c:
        yield c
