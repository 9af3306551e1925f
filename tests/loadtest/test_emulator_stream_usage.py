"""The emulator's streamed usage is vLLM's: `stream_options` reads an absent `include_usage` as
false, `continuous_usage_stats` puts the usage so far on every chunk (only with `include_usage`),
and a chunk without usage has no `usage` key (vLLM leaves it out, not `null`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.processes import running_emulator

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    with running_emulator("--host", "127.0.0.1", "--model", "m") as url:
        yield url


def chunks(url: str, path: str, options: dict[str, Any] | None, **extra: Any) -> list[dict[str, Any]]:
    """The JSON chunks of one streamed answer (`[DONE]` left out)."""
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": MAX_TOKENS, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    if options is not None:
        body["stream_options"] = options
    resp = httpx.post(url + path, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    events = [e[6:] for e in resp.content.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_puts_the_usage_so_far_on_every_chunk(emulator: str, path: str) -> None:
    got = chunks(emulator, path, {"include_usage": True, "continuous_usage_stats": "true"})
    content, final = got[:-1], got[-1]
    assert len(content) == MAX_TOKENS
    prompt = final["usage"]["prompt_tokens"]
    for i, chunk in enumerate(content, start=1):
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": i, "total_tokens": prompt + i}
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == MAX_TOKENS


@pytest.mark.parametrize(
    ("options", "final_usage"),
    [
        (None, False),
        ({"include_usage": True}, True),
        ({}, False),  # vLLM 0.33's StreamOptions: include_usage defaults to false
        ({"continuous_usage_stats": True}, False),  # needs include_usage
        ({"include_usage": None}, False),
        ({"include_usage": False, "continuous_usage_stats": True}, False),  # needs include_usage
    ],
)
def test_chunks_without_usage_have_no_usage_key(
    emulator: str, options: dict[str, Any] | None, final_usage: bool
) -> None:
    got = chunks(emulator, "/v1/chat/completions", options)
    content = got[:-1] if final_usage else got
    assert len(content) == MAX_TOKENS and all("usage" not in chunk for chunk in content)
    if final_usage:
        assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_continuous_usage_counts_each_choice_on_its_own(emulator: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    got = chunks(emulator, "/v1/chat/completions", options, n=2)
    for index in (0, 1):
        mine = [
            c["usage"]["completion_tokens"] for c in got if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert mine == list(range(1, MAX_TOKENS + 1))
