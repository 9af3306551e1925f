"""The emulator reads booleans and integers as vLLM's lax pydantic models do: `"stream": "true"`,
`"n": "2"`, `"max_tokens": 3.0` are served; what lax mode refuses (`"maybe"`, 2.5) is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.processes import running_emulator


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    with running_emulator("--host", "127.0.0.1", "--model", "m") as url:
        yield url


def _post(url: str, **fields: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def test_lax_values_are_read_as_vllm_reads_them(emulator: str) -> None:
    resp = _post(
        emulator, stream="true", n="2", max_tokens=3.0, priority="0", logprobs="yes", top_logprobs="1"
    )
    assert resp.status_code == 200, resp.text
    chunks = [orjson.loads(e[6:]) for e in resp.content.split(b"\n\n") if e.startswith(b"data: {")]
    assert sorted({c["choices"][0]["index"] for c in chunks}) == [0, 1]
    assert len(chunks) == 2 * 3 and all(c["choices"][0]["logprobs"] for c in chunks)
    whole = _post(emulator, stream=0, max_tokens="2").json()
    assert whole["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", "maybe"), ("stream", 2), ("n", 2.5), ("max_tokens", "two"), ("priority", None)],
)
def test_what_lax_mode_refuses_is_a_400(emulator: str, field: str, value: Any) -> None:
    resp = _post(emulator, **{field: value})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field
